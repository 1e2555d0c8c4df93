"""DeepSeek Sparse Attention's lightning indexer: which cached tokens each query attends to (``topk`` context
positions per query, ``-1`` past the visible ones). docs/model-families.md has the details."""
from __future__ import annotations

import torch
from torch import nn

from ..layers import Linear, RotaryEmbedding
from ..paging import PagedInputs
from .config import INDEXER_NORM_EPS, DsaConfig
from .sparse_kernels import npu_select

#: a selection with nothing there: fewer visible tokens than ``topk``, or a pad row
NO_TOKEN = -1


class Indexer(nn.Module):
    """``wq_b`` on the query latent, ``wk`` + LayerNorm on the layer's input, RoPE on the first
    ``qk_rope_head_dim`` channels of both (half-split for DeepSeek-V3.2, interleaved for GLM-5), ``weights_proj``
    for the per-head weights. HF parameter names (``self_attn.indexer.*``)."""

    def __init__(self, cfg: DsaConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        ic = cfg.indexer
        self.n_heads, self.head_dim, self.topk = ic.n_heads, ic.head_dim, ic.topk
        self.rope_dim = cfg.qk_rope_head_dim
        self.rope = rope
        self.half_split_rope = ic.rope == "half"
        self.wq_b = Linear(cfg.q_lora_rank, ic.n_heads * ic.head_dim, bias=False)
        self.wk = Linear(cfg.hidden_size, ic.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(ic.head_dim, eps=INDEXER_NORM_EPS)
        self.weights_proj = Linear(cfg.hidden_size, ic.n_heads, bias=False)
        #: ``x → (wk(x), weights_proj(x))`` in one GEMM where a host engine keeps the two merged (vLLM's
        #: ``wk_weights_proj``); None: the two projections apart
        self.wk_and_weights: nn.Module | None = None

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [..., heads, head_dim]: the first ``rope_dim`` channels roped, the rest as they are."""
        rot, rest = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        rot = self.rope.rotate_halves(rot, positions) if self.half_split_rope else self.rope(rot, positions)
        return torch.cat([rot, rest], dim=-1)

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer input ``x [B, Q, D]`` → (the keys it caches ``[B, Q, head_dim]``, the per-head weights of its
        queries ``[B, Q, H]``)."""
        k, weights = self.wk_and_weights(x) if self.wk_and_weights is not None else (self.wk(x), self.weights_proj(x))
        return self._rope(self.k_norm(k).unsqueeze(-2), positions).squeeze(-2), weights

    def keys(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.project(x, positions)[0]

    def _queries(self, q_resid: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q = self.wq_b(q_resid).view(*q_resid.shape[:-1], self.n_heads, self.head_dim)
        return self._rope(q, positions)

    def _scores(self, weights: torch.Tensor, q_resid: torch.Tensor, positions: torch.Tensor,
                keys: torch.Tensor) -> torch.Tensor:
        """Index scores ``[B, Q, W]`` of queries at ``positions`` (per-head ``weights [B, Q, H]``) against ``keys
        [B, W, head_dim]``, in float32 (as transformers and vLLM score them)."""
        q = self._queries(q_resid, positions).float()  # [B, Q, H, d]
        scores = torch.relu(torch.einsum("bqhd,bwd->bqhw", q, keys.float()) * self.head_dim ** -0.5)
        return torch.einsum("bqh,bqhw->bqw", weights.float() * self.n_heads ** -0.5, scores)

    #: select with torch_npu's lightning indexer (``sparse_kernels.npu_select``); set with the NPU attention kernel
    on_npu = False

    def select_paged(self, weights: torch.Tensor, q_resid: torch.Tensor, inp: PagedInputs,
                     key_cache: torch.Tensor) -> torch.Tensor:
        """Top-k context positions ``[B, Q, topk]`` (``NO_TOKEN`` past the visible ones) of each query (its per-head
        ``weights`` from :meth:`project`), scored against the request's cached keys (this forward's already
        written): its live blocks of ``key_cache [blocks, block, head_dim]`` through ``inp.block_table``."""
        if self.on_npu:
            return npu_select(self._queries(q_resid, inp.positions), weights, key_cache, inp, self.topk)
        keys = key_cache[inp.block_table.long()].flatten(1, 2)  # [B, W, d], W = table width × block
        scores = self._scores(weights, q_resid, inp.positions, keys)
        key_pos = torch.arange(keys.shape[1], device=keys.device)
        visible = (key_pos.view(1, 1, -1) <= inp.positions.unsqueeze(-1)) & (
            key_pos.view(1, 1, -1) < inp.seq_lens.view(-1, 1, 1))
        return top_positions(scores, visible, self.topk)

    def select_dense(self, x: torch.Tensor, q_resid: torch.Tensor) -> torch.Tensor:
        """The same over whole sequences ``x [B, S, D]`` at positions 0..S-1, causal, no cache."""
        s = x.shape[1]
        positions = torch.arange(s, device=x.device).expand(x.shape[0], s)
        keys, weights = self.project(x, positions)
        scores = self._scores(weights, q_resid, positions, keys)
        visible = torch.ones(s, s, dtype=torch.bool, device=x.device).tril().expand(x.shape[0], s, s)
        return top_positions(scores, visible, self.topk)


def top_positions(scores: torch.Tensor, visible: torch.Tensor, topk: int) -> torch.Tensor:
    """``[B, Q, topk]`` positions of the best visible ``scores [B, Q, W]``, best first, ``NO_TOKEN`` where fewer
    are visible.

    The scores are padded with ``topk`` invisible columns, so one ``topk``-wide selection serves every context
    width (no ``min(topk, W)``: that would make the context a graph dimension). Equal scores go to the earlier
    position, whatever the width and the query count: ReLU scores tie at exactly 0 often enough, and ``topk``'s
    order among ties follows its shapes, so a verify and a decode step would attend different tokens. The order is
    made total in one int64 key (the score's order-preserving bits, then the position reversed), so the selection
    is one ``topk``, linear in the context, not a sort."""
    scores = scores.masked_fill(~visible, float("-inf"))
    padded = torch.cat([scores, scores.new_full((*scores.shape[:-1], topk), float("-inf"))], dim=-1)
    _, positions = ordered_keys(padded).topk(topk, dim=-1)
    values = torch.gather(padded, -1, positions)
    return torch.where(values > float("-inf"), positions, torch.full_like(positions, NO_TOKEN))


def ordered_keys(scores: torch.Tensor) -> torch.Tensor:
    """int64 keys ordered as ``(score, -position)``: float32 bits made monotone (negative floats' magnitude bits
    flipped; ``-0.0`` first made ``+0.0``, which it equals) in the high half, ``2**32 - 1 - position`` below."""
    bits = (scores.float() + 0.0).view(torch.int32)
    monotone = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()
    position = torch.arange(scores.shape[-1], device=scores.device)
    return monotone * (1 << 32) + ((1 << 32) - 1 - position)


def selection_mask(selected: torch.Tensor, width: int) -> torch.Tensor:
    """``[B, Q, topk]`` positions → a ``[B, Q, width]`` boolean mask of the selected ones."""
    hit = torch.zeros(*selected.shape[:-1], width + 1, dtype=torch.bool, device=selected.device)
    # NO_TOKEN lands in the extra last column, dropped
    return hit.scatter(-1, torch.where(selected >= 0, selected, width), True)[..., :width]
