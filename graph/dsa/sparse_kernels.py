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


SPARSE_KERNELS: dict[str, SparseMLAKernel] = {"gather": gather_sparse_mla}
