"""What every family's paged forward takes, whatever its attention: the per-forward inputs and the live width of a
block table."""
from __future__ import annotations

from typing import NamedTuple

import torch


class PagedInputs(NamedTuple):
    """Per-forward attention inputs, all fixed-shape. ``B`` requests × ``Q`` query tokens each."""

    positions: torch.Tensor  # [B, Q] int64
    slot_mapping: torch.Tensor  # [B, Q] int64; -1 = write nothing (pad rows / pad tokens)
    block_table: torch.Tensor  # [B, M] int32/int64; block ids of each request, in position order
    seq_lens: torch.Tensor  # [B] int64; tokens in the cache after this forward (0 for pad rows)
    #: per request, as host ints from the runner's own counts (never read back from the device), the KV length
    #: its query block ends at: the first query's position + Q. That is ``seq_lens`` for a full block (a verify);
    #: a block right-padded with inert tokens (a short prompt in a batch, a verify reaching past
    #: ``max_model_len``) ends at its padded end, so that the op's causal diagonal, aligned to the last key, puts
    #: each real token on its own position. An upper bound
    #: where the exact length follows acceptance (draft steps 2..K). Only :func:`npu_mla` reads it.
    seq_lens_host: tuple[int, ...] | None = None
    #: the KV lengths are ``seq_lens`` itself, handed to the op as a device tensor (torchair's Tensor-length
    #: attention; ``seq_lens_host`` is None then): the draft chain's exact lengths, no host read. Set in GE graphs
    #: only (``graph.steps``): that op has no eager kernel.
    kv_lens_on_device: bool = False


#: what the host lengths are called in every step function, and the Dynamo sources that mark them dynamic
#: (``torch.compiler.config.dynamic_sources``: one graph for every length, pad rows' 0 included)
HOST_LENGTHS_ARG = "seq_lens_host"
HOST_LENGTHS_SOURCES = rf"L\['{HOST_LENGTHS_ARG}'\]\[\d+\]"


def live_blocks(longest_tokens: int, max_blocks: int, block_size: int, minimum: int = 2) -> int:
    """Block-table width that covers ``longest_tokens`` in blocks of ``block_size`` (at least ``minimum``: a width
    of 1 would specialise a dynamic dimension and compile a second graph), capped at ``max_blocks``."""
    return min(max(-(-longest_tokens // block_size), minimum), max_blocks)
