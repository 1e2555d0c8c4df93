"""Sparse MLA: latent queries against only the cached tokens the indexer selected.
The reference kernel reads ``topk`` tokens per query, whatever the context length."""
from __future__ import annotations

from typing import Protocol

import torch

from ..mla_kernels import CacheParts
from ..paging import PagedInputs


class SparseMLAKernel(Protocol):
    def __call__(self, q_lat: torch.Tensor, q_pe: torch.Tensor, cache: CacheParts, inp: PagedInputs,
                 selected: torch.Tensor, scale: float) -> torch.Tensor:
        """``q_lat [B, Q, H, C]``, ``q_pe [B, Q, H, R]``, ``cache = (kv_c, kv_pe)``, ``selected [B, Q, topk]``
        context positions (``-1``: none) → ``o_lat [B, Q, H, C]``."""
        ...


def gather_sparse_mla(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: CacheParts, inp: PagedInputs,
                      selected: torch.Tensor, scale: float) -> torch.Tensor:
    kv_c, kv_pe = cache
    block = kv_c.shape[1]
    valid = selected >= 0
    # A query with nothing selected (a pad row) reads its column 0, key 0 of its first block: finite, discarded.
    valid = valid | ((torch.arange(selected.shape[-1], device=selected.device) == 0) & ~valid.any(-1, keepdim=True))
    pos = torch.where(selected >= 0, selected, torch.zeros_like(selected)).long()
    table = inp.block_table.long().unsqueeze(1).expand(-1, selected.shape[1], -1)  # [B, Q, M]
    blocks = torch.gather(table, 2, torch.div(pos, block, rounding_mode="floor"))
    offsets = pos % block
    # (block, offset) indexing reads the selected rows only, from a single cache's views too (no flattening copy)
    sel_c = kv_c[blocks, offsets].float()  # [B, Q, k, C]
    sel_pe = kv_pe[blocks, offsets].float()
    scores = (torch.einsum("bqhc,bqkc->bqhk", q_lat.float(), sel_c)
              + torch.einsum("bqhr,bqkr->bqhk", q_pe.float(), sel_pe)) * scale
    scores = scores.masked_fill(~valid.unsqueeze(2), float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return torch.einsum("bqhk,bqkc->bqhc", weights, sel_c).to(q_lat.dtype)


#: torch_npu's DSA ops (torch_npu 2.14.0 declares both with GE converters; their lengths are device tensors): every
#: keyword argument we pass (the contract test checks them against the wheel's schemas)
NPU_INDEXER_OP = "npu_lightning_indexer"
NPU_INDEXER_KWARGS = ("actual_seq_lengths_query", "actual_seq_lengths_key", "block_table", "layout_query",
                      "layout_key", "sparse_count", "sparse_mode")
NPU_SPARSE_ATTENTION_OP = "npu_sparse_flash_attention"
NPU_SPARSE_ATTENTION_KWARGS = ("block_table", "actual_seq_lengths_query", "actual_seq_lengths_kv", "query_rope",
                               "key_rope", "sparse_block_size", "layout_query", "layout_kv", "sparse_mode",
                               "attention_mode")
#: vllm-ascend's SFA layouts: query rows of all requests (``TND``), paged caches ``[blocks, block, 1, width]``
NPU_QUERY_LAYOUT, NPU_CACHE_LAYOUT = "TND", "PA_BSND"
#: causal from the bottom right: query i of a block of Q ending at KV length L sees positions ``< L - Q + 1 + i``
NPU_CAUSAL_MODE = 3
#: the sparse attention's only supported mode (torch_npu's default, 0, is not): the absorbed MLA form
NPU_ATTENTION_MODE = 2


def npu_lengths(inp: PagedInputs, q_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cumulative query lengths, KV lengths)``, int32 on the device: each row's query block of ``q_len`` ends at
    its first position + ``q_len`` (a row right-padded with inert tokens ends at its padded end, so the causal
    diagonal puts each real token on its own position; a pad row reads only discarded keys)."""
    b = inp.positions.shape[0]
    q_lens = torch.arange(1, b + 1, dtype=torch.int32, device=inp.positions.device) * q_len
    return q_lens, (inp.positions[:, 0] + q_len).to(torch.int32)


def npu_select(q: torch.Tensor, weights: torch.Tensor, key_cache: torch.Tensor, inp: PagedInputs,
               topk: int) -> torch.Tensor:
    """The lightning indexer on the NPU: ``q [B, Q, H, d]`` (roped), per-head ``weights [B, Q, H]``, the key cache
    ``[blocks, block, d]`` → ``[B, Q, topk]`` positions (int64, ``-1`` past the visible ones). The op scores
    ``Σ_h w_h · relu(q_h · k)`` without our positive scale factors: the same ranking."""
    import torch_npu  # needs CANN; imported on the NPU path only

    b, q_len, h, d = q.shape
    q_lens, kv_lens = npu_lengths(inp, q_len)
    indices, _ = torch_npu.npu_lightning_indexer(
        q.reshape(b * q_len, h, d).contiguous(), key_cache.view(key_cache.shape[0], key_cache.shape[1], 1, d),
        weights.reshape(b * q_len, h).to(q.dtype).contiguous(),
        actual_seq_lengths_query=q_lens, actual_seq_lengths_key=kv_lens,
        block_table=inp.block_table.to(torch.int32), layout_query=NPU_QUERY_LAYOUT, layout_key=NPU_CACHE_LAYOUT,
        sparse_count=topk, sparse_mode=NPU_CAUSAL_MODE)
    return indices.view(b, q_len, topk).long()


def npu_sparse_mla(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: CacheParts, inp: PagedInputs,
                   selected: torch.Tensor, scale: float) -> torch.Tensor:
    """torch_npu's sparse flash attention, as vllm-ascend's SFA backend calls it: TND queries, the nope / rope
    caches ``PA_BSND``, the indexer's positions (valid ones first: the op stops at a row's first ``-1``)."""
    import torch_npu  # needs CANN; imported on the NPU path only

    b, q_len, h, c = q_lat.shape
    kv_c, kv_pe = cache
    if not (kv_c.is_contiguous() and kv_pe.is_contiguous()):
        raise ValueError("npu_sparse_mla takes contiguous nope / rope caches (vllm-ascend's layout); this cache is a "
                         "single 576-wide one: allocate it as a pair (kv_layout 'pair', --kv-layout pair)")
    num_blocks, block = kv_c.shape[0], kv_c.shape[1]
    q_lens, kv_lens = npu_lengths(inp, q_len)
    key = kv_c.view(num_blocks, block, 1, c)
    out, _, _ = torch_npu.npu_sparse_flash_attention(
        q_lat.reshape(b * q_len, h, c).contiguous(), key, key,
        selected.reshape(b * q_len, 1, -1).to(torch.int32), scale,
        block_table=inp.block_table.to(torch.int32), actual_seq_lengths_query=q_lens, actual_seq_lengths_kv=kv_lens,
        query_rope=q_pe.reshape(b * q_len, h, -1).contiguous(),
        key_rope=kv_pe.view(num_blocks, block, 1, kv_pe.shape[-1]), sparse_block_size=1,
        layout_query=NPU_QUERY_LAYOUT, layout_kv=NPU_CACHE_LAYOUT, sparse_mode=NPU_CAUSAL_MODE,
        attention_mode=NPU_ATTENTION_MODE)
    return out.view(b, q_len, h, c)


SPARSE_KERNELS: dict[str, SparseMLAKernel] = {"gather": gather_sparse_mla, "npu": npu_sparse_mla}
