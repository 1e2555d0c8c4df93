"""Requests → a step's inputs: the block table's width and rows, cache slots, ragged chunks right-padded into
``[B, n]``, the step-by-step path's verify, and the fused path's device-side batch (:class:`DeviceBatch`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .graph.paging import live_blocks
from .requests import Sequence
from .sampling import GREEDY, SamplingParams, SamplingTensors


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


def verify_inputs(running: list[Sequence], k: int, width: int, max_model_len: int, block_size: int,
                  device: torch.device) -> tuple[torch.Tensor, ...]:
    """The step-by-step path's verify ``[B, 1 + k]``: each request's last token and drafts, their positions and
    slots (past ``max_model_len``: position 0, no slot), the block table (``width`` columns) and seq_lens."""
    q = 1 + k
    ids, pos, slots = [], [], []
    for seq in running:
        positions = [seq.num_tokens - 1 + j for j in range(q)]  # from the last token's, already cached before it
        ids.append([seq.last_token] + seq.draft_ids[:k])
        pos.append([x if x < max_model_len else 0 for x in positions])
        slots.append(slots_of(seq, positions, max_model_len, block_size))
    seq_lens = [min(s.num_tokens - 1 + q, max_model_len) for s in running]
    return tuple(torch.tensor(x, dtype=torch.long, device=device)
                 for x in (ids, pos, slots, [block_row(s, width) for s in running], seq_lens))


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


@dataclass
class DeviceBatch:
    """The running batch's next step inputs, on device, padded to its graph rows (pad rows: ``live`` False).

    The fused graph advances ``input_ids`` and ``start`` itself; the host rebuilds the batch only when its
    composition, K, sampling mode or logprobs change.
    """

    req_ids: tuple[int, ...]
    k: int
    mode: str
    input_ids: torch.Tensor  # [Bp, 1+k]: last token, then the drafts
    start: torch.Tensor  # [Bp]: position of input_ids[:, 0]
    num_draft: torch.Tensor  # [Bp]
    num_draft_host: list[int]  # the same, for the real rows (metrics)
    block_table: torch.Tensor  # [Bp, M]: full width; each step passes the live columns
    live: torch.Tensor  # [Bp] bool
    sampling: SamplingTensors  # fields [Bp]
    logprobs: bool = False
    #: blocks each real row's request held when ``block_table`` was built (a grown one rebuilds the table)
    blocks_held: tuple[int, ...] = ()

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]


def block_table(running: list[Sequence], rows: int, max_blocks: int, device: torch.device) -> torch.Tensor:
    """``[rows, max_blocks]``: each running request's blocks, then null rows for the padding."""
    table = [block_row(s, max_blocks) for s in running] + [[0] * max_blocks] * (rows - len(running))
    return torch.tensor(table, dtype=torch.long, device=device)


def inert_batch(rows: int, k: int, max_blocks: int, device: torch.device) -> DeviceBatch:
    """A batch of pad rows only (warm-up and step timing replay it: shapes, not data, set a step's cost)."""
    # Distinct tensors: Dynamo guards on aliasing, and a run never passes one tensor twice.
    return DeviceBatch((), k, GREEDY, torch.zeros(rows, 1 + k, dtype=torch.long, device=device),
                       torch.zeros(rows, dtype=torch.long, device=device),
                       torch.zeros(rows, dtype=torch.long, device=device), [],
                       torch.zeros(rows, max_blocks, dtype=torch.long, device=device),
                       torch.zeros(rows, dtype=torch.bool, device=device),
                       SamplingTensors.greedy_batch(rows, device))


def device_batch(running: list[Sequence], rows: int, k: int, mode: str, logprobs: bool, old: DeviceBatch | None,
                 max_blocks: int, device: torch.device) -> DeviceBatch:
    """Device state for ``running`` padded to ``rows``: drafts of rows already in the ``old`` batch are gathered on
    device (they never went to the host); requests just prefilled bring theirs from the host."""
    b = len(running)
    old_rows = {rid: i for i, rid in enumerate(old.req_ids)} if old is not None else {}
    drafts = torch.zeros(rows, k, dtype=torch.long, device=device)
    counts = []
    from_old = [(i, old_rows[s.req_id]) for i, s in enumerate(running) if s.req_id in old_rows]
    if from_old and k:
        assert old is not None
        dst, src = (torch.tensor(x, dtype=torch.long, device=device) for x in zip(*from_old))
        width = min(k, old.k)
        drafts[dst, :width] = old.input_ids.index_select(0, src)[:, 1: 1 + width]
    for i, s in enumerate(running):
        j = old_rows.get(s.req_id)
        if j is not None:
            assert old is not None
            counts.append(min(old.num_draft_host[j], k))
        else:
            own = s.draft_ids[:k]
            if own:
                drafts[i, : len(own)] = torch.tensor(own, dtype=torch.long, device=device)
            counts.append(len(own))
    pad = rows - b
    last = torch.tensor([s.last_token for s in running] + [0] * pad, dtype=torch.long, device=device)
    return DeviceBatch(
        req_ids=tuple(s.req_id for s in running), k=k, mode=mode,
        input_ids=torch.cat([last.view(-1, 1), drafts], dim=1),
        start=torch.tensor([s.num_tokens - 1 for s in running] + [0] * pad, dtype=torch.long, device=device),
        num_draft=torch.tensor(counts + [0] * pad, dtype=torch.long, device=device), num_draft_host=counts,
        block_table=block_table(running, rows, max_blocks, device),
        live=torch.tensor([True] * b + [False] * pad, device=device),
        sampling=SamplingTensors.from_params([s.params for s in running] + [SamplingParams()] * pad, device),
        logprobs=logprobs, blocks_held=tuple(len(s.blocks) for s in running))
