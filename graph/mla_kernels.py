"""The paged MLA attention seam: latent queries against each request's cached blocks.

Absorbed MLA is multi-query attention with one latent KV head: ``q·k`` over ``[c_kv ; k_pe]`` (576 wide),
values ``c_kv`` (512 wide). Every kernel here computes the same function of the same inputs:

    o_lat [B, Q, H, C] = softmax(scale · (q_lat·c_kv + q_pe·k_pe), keys visible to each query) · c_kv

over the keys of request ``b`` at positions ``p < seq_lens[b]`` and ``p <= positions[b, q]``, read through
``block_table[b]``. The block table and ``seq_lens`` are data: no shape here depends on a request's context.

- :func:`gather_mla` — the reference (eager oracle): gathers the block table's whole width. Its cost follows
  that width, so callers that compile it with a dynamic width pass a table trimmed to the live blocks
  (``Backend.trims_context``): on CPU inductor one graph serves every width and the step costs what the longest
  live request reads, not ``max_model_len``.
- :func:`flex_mla` — FlexAttention with a block-sparse mask built from the block table (each row visits only
  its ``ceil(seq_len / block_size)`` blocks). Eager it matches the reference; compiled, no backend
  can use it yet: on CPU (torch 2.13) its output is wrong, and on CUDA (torch 2.11, H100) the Triton template
  cannot take MLA's 576-wide keys (shared memory overflows at the default tiles; a 1-3 token query block is not
  a multiple of its 16-row tile; with both forced, the output is wrong). Kept, with its eager test, for when a
  torch release compiles it.
- :func:`npu_mla` — ``torch_npu.npu_fused_infer_attention_score`` with ``block_table`` and the actual KV
  lengths, as vllm-ascend's torchair MLA decode called it (BSND, latent as ``key``/``value``, rope parts as
  ``query_rope``/``key_rope``); checked against the torch_npu 2.14 wheel's schema and composed under a stand-in
  ``torch_npu`` off-NPU.
Pad rows (``seq_lens == 0``) get a finite, discarded result. Every kernel takes the cache as the pair
``(kv_c [num_blocks, block_size, C], kv_pe [num_blocks, block_size, R])`` (views of a fused cache, or vllm-ascend's
nope/rope tensors; :func:`.latent_cache.latent_parts`), of any block size.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch



class PagedInputs(NamedTuple):
    """Per-forward attention inputs, all fixed-shape. ``B`` requests × ``Q`` query tokens each."""

    positions: torch.Tensor  # [B, Q] int64
    slot_mapping: torch.Tensor  # [B, Q] int64; -1 = write nothing (pad rows / pad tokens)
    block_table: torch.Tensor  # [B, M] int32/int64; block ids of each request, in position order
    seq_lens: torch.Tensor  # [B] int64; tokens in the cache after this forward (0 for pad rows)


class MLAKernel(Protocol):
    def __call__(self, q_lat: torch.Tensor, q_pe: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor],
                 inp: PagedInputs, scale: float) -> torch.Tensor:
        """``q_lat [B, Q, H, C]``, ``q_pe [B, Q, H, R]``, ``cache (kv_c [N, block, C], kv_pe [N, block, R])`` →
        ``o_lat [B, Q, H, C]``."""
        ...


def gather_mla(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor],
               inp: PagedInputs, scale: float) -> torch.Tensor:
    table = inp.block_table.long()
    ctx_c, ctx_pe = (part[table].flatten(1, 2) for part in cache)  # [B, M*block, C], [B, M*block, R]
    scores = torch.einsum("bqhc,bkc->bqhk", q_lat, ctx_c) + torch.einsum("bqhr,bkr->bqhk", q_pe, ctx_pe)
    scores = scores.float() * scale
    key_pos = torch.arange(ctx_c.shape[1], device=q_lat.device)
    visible = (key_pos.view(1, 1, -1) <= inp.positions.unsqueeze(-1)) & (
        key_pos.view(1, 1, -1) < inp.seq_lens.view(-1, 1, 1))
    # Key 0 stays visible so that pad rows (seq_len 0) get a finite, discarded result, not NaN.
    visible = visible | (key_pos == 0).view(1, 1, -1)
    scores = scores.masked_fill(~visible.unsqueeze(2), float("-inf"))
    # softmax, its denominator a matmul: inductor specialises a compiled sum on its length (past 4,096 terms it
    # switches to a chunked accumulator and guards on it), which would make the context length a graph key.
    e = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    denom = torch.matmul(e, torch.ones(e.shape[-1], 1, dtype=e.dtype, device=e.device))
    return torch.einsum("bqhk,bkc->bqhc", (e / denom).to(ctx_c.dtype), ctx_c)


def flex_mla(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor],
             inp: PagedInputs, scale: float) -> torch.Tensor:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    b, q_len, h, c = q_lat.shape
    num_blocks, block, _ = cache[0].shape
    # The whole pool as keys (kv block i is physical block i). FlexAttention takes one key tensor, so a cache pair
    # is concatenated: this kernel is the eager oracle of a masked pool, not a fast path.
    keys = torch.cat(cache, dim=-1).view(1, 1, num_blocks * block, -1)
    table = inp.block_table.long()
    m = table.shape[1]
    # Each row visits its live blocks only (at least one, so pad rows stay finite); dead table entries point
    # at the null block and are never visited.
    live_blocks = ((inp.seq_lens + block - 1) // block).clamp(min=1, max=m)
    kv_indices = torch.cat([table, table.new_zeros(b, num_blocks - m)], dim=1) if num_blocks > m else table
    # physical block → logical block of each row, for the causal mask (-1: not this row's)
    logical = torch.full((b, num_blocks), -1, dtype=torch.long, device=table.device).scatter(
        1, table, torch.arange(m, device=table.device).expand(b, m))
    positions, seq_lens = inp.positions, inp.seq_lens

    def mask_mod(bi: Any, hi: Any, qi: Any, ki: Any) -> Any:
        pos = logical[bi, ki // block] * block + ki % block
        return ((pos <= positions[bi, qi]) & (pos < seq_lens[bi]) & (logical[bi, ki // block] >= 0)) | (
            (seq_lens[bi] == 0) & (ki == 0))

    mask = BlockMask.from_kv_blocks(live_blocks.view(b, 1, 1).int(), kv_indices.view(b, 1, 1, -1).int(),
                                    BLOCK_SIZE=(q_len, block), mask_mod=mask_mod,
                                    seq_lengths=(q_len, num_blocks * block))
    query = torch.cat([q_lat, q_pe], dim=-1).transpose(1, 2)  # [B, H, Q, C + R]
    out = flex_attention(query, keys, keys[..., :c], block_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


#: torch_npu's fused attention: every argument name we pass (the contract test checks them against the wheel).
NPU_ATTENTION_OP = "npu_fused_infer_attention_score"
NPU_ATTENTION_KWARGS = ("query_rope", "key_rope", "num_heads", "num_key_value_heads", "input_layout", "scale",
                        "block_table", "block_size", "actual_seq_lengths_kv", "atten_mask", "sparse_mode")


def npu_mla(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor],
            inp: PagedInputs, scale: float) -> torch.Tensor:
    """One query token per row and call (BNSD, as vllm-ascend's torchair decode): ``Q`` verify tokens become
    ``B·Q`` rows whose KV length ends at their own position, so causality needs no mask."""
    import torch_npu  # needs CANN; imported on the NPU path only

    b, q_len, h, c = q_lat.shape
    num_blocks, block, _ = cache[0].shape
    kv_c, kv_pe = (part.view(num_blocks, 1, block, -1) for part in cache)
    # row (b, q) attends to keys [0, positions[b, q]]; pad rows (seq_len 0) read one key of the null block
    kv_len = torch.where(inp.seq_lens.view(-1, 1) > 0, inp.positions + 1, torch.ones_like(inp.positions))
    kv_len = torch.minimum(kv_len, inp.seq_lens.view(-1, 1).clamp(min=1))
    table = inp.block_table.to(torch.int32).repeat_interleave(q_len, dim=0)
    # The op takes the KV lengths as SymInt[]: host ints in eager mode, graph data once torchair lowers it
    # (FusedInferAttentionScore's actual_seq_lengths_kv is a tensor input of the GE op).
    out, _ = torch_npu.npu_fused_infer_attention_score(
        q_lat.reshape(b * q_len, h, 1, c), kv_c, kv_c,
        query_rope=q_pe.reshape(b * q_len, h, 1, -1), key_rope=kv_pe, num_heads=h, num_key_value_heads=1,
        input_layout="BNSD", scale=scale, block_table=table, block_size=block,
        actual_seq_lengths_kv=kv_len.reshape(-1).tolist(), atten_mask=None, sparse_mode=0)
    return out.view(b, q_len, h, c)


KERNELS: dict[str, MLAKernel] = {"gather": gather_mla, "flex": flex_mla, "npu": npu_mla}


def live_blocks(longest_tokens: int, max_blocks: int, block_size: int, minimum: int = 2) -> int:
    """Block-table width that covers ``longest_tokens`` in blocks of ``block_size`` (at least ``minimum``: a width
    of 1 would specialise a dynamic dimension and compile a second graph), capped at ``max_blocks``."""
    return min(max(-(-longest_tokens // block_size), minimum), max_blocks)
