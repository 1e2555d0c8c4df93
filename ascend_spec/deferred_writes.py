"""``DeferredCacheWrites``: the draft cache entries of decode steps that draft nothing (K = 0), held on the device
and written many steps at a time, so that a step which does not speculate costs what plain decoding costs.
"""
from __future__ import annotations

from typing import Container, Sequence

import torch

from .torchair_proposer import MtpTorchairProposer

#: device bytes the held entries may take (hidden states above all); fewer steps are held per write where a row
#: of them is larger (DeepSeek-V3 bf16: 14 KiB a row, 32 steps of 64 rows)
BUDGET_BYTES = 32 << 20


class DeferredCacheWrites:
    """Decode steps at K = 0 (one verified token per row) hand their draft cache entries to :meth:`add`, which only
    copies them into device buffers: the MTP layer's input (next token, target hidden state), position and slot.
    :meth:`flush` writes them all with one call of the K = 0 chain (its cache writes and nothing else), at a query
    width it has a graph for. The entries reach the cache before anything reads it:

    - the caller flushes before every other draft call (a drafting K reads the cache; a prefill writes it, and a
      freed block's slot may be written by the block's next owner, whose write must land last);
    - :meth:`add` flushes first when the batch's requests (``key``) change, so one flush never holds two writes of
      a slot (a freed block reused within the window), whose order a scatter would not keep.

    Where the caller names the requests still running (``live``), entries held for requests that have all ended
    (finished, aborted or preempted: a resumed request's prefill writes its entries again) are dropped unwritten:
    no draft reads them, and their blocks may have a new owner already.

    A batch above the chain's largest bucket is not held (:meth:`takes`): it runs eagerly as before.
    """

    def __init__(self, chain: MtpTorchairProposer, budget_bytes: int = BUDGET_BYTES) -> None:
        if chain.num_speculative_tokens != 0:
            raise ValueError(f"DeferredCacheWrites: chain drafts K={chain.num_speculative_tokens}; allowed: the K = 0 "
                             "chain (its cache writes only)")
        self.chain = chain
        wide = [w for w in chain.graph.query_widths if w > 1]
        #: steps held at most: the narrowest width above 1 that the chain has a graph for (it pads the rest)
        self.max_steps = min(wide) if wide else 0
        self.budget_bytes = budget_bytes
        self._buffers: dict[int, tuple[torch.Tensor, ...]] = {}
        self._rows = 0  # the bucket the held entries fill, 0: nothing held
        self._steps = 0  # columns filled
        self._key: list[str] | None = None
        self.held_steps = 0  # stats: steps added, flushes that wrote, held entries dropped (their requests ended)
        self.flushes = 0
        self.dropped = 0

    def takes(self, batch: int) -> bool:
        """Whether a K = 0 decode step of ``batch`` rows can be held (a graph bucket and a width exist)."""
        return self.max_steps > 1 and self.chain.graph.rows_for(batch) is not None

    def add(self, next_token_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
            slot_mapping: torch.Tensor, key: Sequence[str], live: Container[str] | None = None) -> None:
        """Hold one K = 0 decode step: ``[B]`` next tokens, positions and slots, ``[B, D]`` target hidden states
        (copied: the runner reuses its buffers). ``key`` names the batch's requests in row order; ``live``: the
        requests still running (None: unknown)."""
        b = next_token_ids.shape[0]
        rows = self.chain.graph.rows_for(b)
        if rows is None:
            raise ValueError(f"DeferredCacheWrites.add: a batch of {b} rows; allowed: at most "
                             f"{self.chain.graph.max_size} (check takes() first)")
        if self._steps and (rows != self._rows or list(key) != self._key or self._steps == self._capacity(rows)):
            self.flush(live)
        if not self._steps:
            self._rows, self._key = rows, list(key)  # a copy: the runner's list changes in place
        ids, pos, hid, slots = self._buffer(rows, hidden)[:4]
        c = self._steps
        ids[:b, c].copy_(next_token_ids)
        pos[:b, c].copy_(positions)
        hid[:b, c].copy_(hidden)
        slots[:b, c].copy_(slot_mapping)
        self._steps += 1
        self.held_steps += 1

    @property
    def pending(self) -> int:
        """Steps held and not written yet."""
        return self._steps

    def flush(self, live: Container[str] | None = None) -> None:
        """Write every held entry into the draft cache (one K = 0 chain call); nothing if none is held, or if
        ``live`` (the requests still running) holds none of theirs (then they are dropped)."""
        if not self._steps:
            return
        ids, pos, hid, slots, zeros, table = self._buffers[self._rows]
        if live is not None and not any(r in live for r in self._key):
            slots.fill_(-1)
            self._steps, self._key = 0, None
            self.dropped += 1
            return
        rows = self._rows
        # Only slots matter to a K = 0 chain: table, lengths and the sampled index are read by no op of it.
        lens_host = (1,) * rows if self.chain.model.takes_host_lengths else None
        self.chain._run_draft(ids, pos, hid, zeros, slots, table, zeros, self.chain.row_limits(rows, ids.device),
                              seq_lens_host=lens_host)
        slots.fill_(-1)
        self._steps, self._key = 0, None
        self.flushes += 1

    def _capacity(self, rows: int) -> int:
        return self._buffers[rows][0].shape[1]

    def _buffer(self, rows: int, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        made = self._buffers.get(rows)
        if made is None:
            row_bytes = rows * like.shape[-1] * like.element_size()
            steps = max(2, min(self.max_steps, self.budget_bytes // max(row_bytes, 1)))
            dev = like.device
            ids = torch.zeros(rows, steps, dtype=torch.long, device=dev)
            made = self._buffers[rows] = (ids, torch.zeros_like(ids),
                                          torch.zeros(rows, steps, like.shape[-1], dtype=like.dtype, device=dev),
                                          torch.full_like(ids, -1), torch.zeros(rows, dtype=torch.long, device=dev),
                                          torch.zeros(rows, self.chain.table_width, dtype=torch.long, device=dev))
        return made
