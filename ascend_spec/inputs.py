"""Requests → a step's inputs, on the host: how far a step reaches into a request's cache, the drafts that fit
below ``max_model_len``, the block table's width and rows, cache slots, and ragged chunks right-padded into
``[B, n]``.

The scheduler sizes a request's blocks with :func:`step_tokens`, the runner builds its tensors with the rest; the
graphs compute the same on device (``graph.latent_cache.slots_for``, the fused step's verify in
:mod:`.fused_step`). The block size is always an argument (the caches': 16 on vLLM's CPU_MLA, 64 on FlashMLA, 128
on vllm-ascend); a request's blocks are a list of block ids whatever the cache layout.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .graph.mla_kernels import live_blocks

if TYPE_CHECKING:
    from .scheduler import Sequence


def step_tokens(num_tokens: int, k: int) -> int:
    """Cache positions a step at K = ``k`` touches, from 0, for a request of ``num_tokens``: the verify writes up to
    ``start + K``, the chained drafts up to ``start + 2K - 1`` (``start = num_tokens - 1``, the last token's)."""
    return num_tokens - 1 + max(1 + k, 2 * k)


def drafts_fit(num_tokens: int, offered: int, max_model_len: int) -> int:
    """Drafts of the ``offered`` a step verifies for a request of ``num_tokens``: room for them and the bonus token
    below ``max_model_len`` (the fused step's verify computes the same on device)."""
    return max(0, min(offered, max_model_len - (num_tokens - 1) - 2))


def table_width(longest_tokens: int, max_blocks: int, block_size: int, trim: bool) -> int:
    """Block-table columns a step passes: the blocks ``longest_tokens`` reach where the backend compiles a dynamic
    width (``trim``: context is data, a step costs what its context does), else all ``max_blocks`` (one recorded
    shape replayed)."""
    return live_blocks(longest_tokens, max_blocks, block_size) if trim else max_blocks


def block_row(seq: Sequence, width: int) -> list[int]:
    """The first ``width`` entries of ``seq``'s block table, padded with the null block."""
    return seq.blocks[:width] + [0] * (width - min(len(seq.blocks), width))


def slots_of(seq: Sequence, positions: list[int], max_model_len: int, block_size: int) -> list[int]:
    """Cache slots of ``positions`` in blocks of ``block_size``; -1 (write nothing) at or past ``max_model_len``."""
    return [seq.blocks[p // block_size] * block_size + p % block_size
            if p < max_model_len else -1 for p in positions]


def pack_chunks(seqs: list[Sequence], tokens: list[list[int]], firsts: list[int], width: int, max_model_len: int,
                block_size: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Consecutive positions per request (``tokens[i]`` from position ``firsts[i]``), right-padded into ``[B, n]``:
    ids, positions, slots, the block table (``width`` columns), seq_lens and each row's last index. Pad tokens
    repeat the row's last position and write nothing: they see only the row's own keys."""
    lens = [len(t) for t in tokens]
    n = max(lens)
    ends = [f + m for f, m in zip(firsts, lens)]
    ids = [t + [0] * (n - len(t)) for t in tokens]
    pos = [list(range(f, e)) + [e - 1] * (n - m) for f, e, m in zip(firsts, ends, lens)]
    slots = [slots_of(s, list(range(f, e)), max_model_len, block_size) + [-1] * (n - m)
             for s, f, e, m in zip(seqs, firsts, ends, lens)]
    table = [block_row(s, width) for s in seqs]
    return tuple(torch.tensor(x, dtype=torch.long, device=device)
                 for x in (ids, pos, slots, table, ends, [m - 1 for m in lens]))


def pad_ragged(query_start_loc: torch.Tensor, width: int, device: torch.device,
               flat: list[tuple[torch.Tensor, int | float]]) -> list[torch.Tensor]:
    """The device twin of :func:`pack_chunks` for a flat ragged batch (row ``i``: ``t[qsl[i]:qsl[i+1]]``, vLLM's
    layout): each tensor of ``flat`` right-padded into ``[B, width, ...]`` with its fill, on device (no host read)."""
    qsl = query_start_loc
    j = torch.arange(width, device=qsl.device).view(1, -1)
    valid = j < (qsl[1:] - qsl[:-1]).view(-1, 1)
    gather = torch.where(valid, qsl[:-1].view(-1, 1) + j, 0).to(device)
    valid = valid.to(device)
    return [torch.where(valid.view(*valid.shape, *[1] * (t.dim() - 1)), t[gather], fill) for t, fill in flat]
