"""What a runner's rooms share: its compiled graphs, caches, backend and config, as one :class:`RunnerParts`, and
the shape and argument helpers every room computes the same way (table width, host lengths, fused replay args).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from . import spec_decode
from .config import EngineConfig, SpeculativeConfig
from .fused_step import SpecStepGraphs, StepKey
from .graph.backends import Backend, ShapePolicy
from .graph.buckets import BucketedGraph
from .graph.steps import RowLimits
from .graphs import GraphRegistry
from .inputs import DeviceBatch, inert_batch, table_width
from .kv_cache import KVCaches
from .requests import Sequence
from .sync_counter import suspended_if_compiled
from .torchair_proposer import MtpTorchairProposer


@dataclass
class RunnerParts:
    """One runner's graphs and what they run on; built once by the runner, read by its rooms."""

    cfg: EngineConfig
    device: torch.device
    backend: Backend
    caches: KVCaches
    #: nominal batch buckets: graph sizes on per-shape backends, the units adaptive K is chosen for everywhere
    batch_sizes: list[int]
    #: every compiled graph of the runner, their warm-up, failures and on-disk key
    graphs: GraphRegistry
    target_graph: BucketedGraph
    prefill_graph: BucketedGraph | None
    prefill_eager: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    proposer: MtpTorchairProposer | None
    spec_graphs: SpecStepGraphs
    vocab_size: int
    #: attention reads KV lengths as host ints (``model.takes_host_lengths``)
    takes_host_lengths: bool
    count_host_syncs: bool = False
    #: greedy replays' placeholder noise, one per (rows, K): the graph takes inputs it does not read
    _unused_noise: dict[tuple[int, int], spec_decode.RejectionNoise] = field(default_factory=dict, repr=False)
    #: the fused step's ``max_len`` input, per row count
    row_limits: RowLimits = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.row_limits = RowLimits(self.cfg.max_model_len)

    @property
    def spec(self) -> SpeculativeConfig | None:
        return self.cfg.speculative

    @property
    def k_max(self) -> int:
        return self.spec.num_speculative_tokens if self.spec else 0

    @property
    def shapes(self) -> ShapePolicy:
        return self.backend.shapes

    @property
    def max_blocks(self) -> int:
        return self.caches.max_blocks_per_seq

    def width_for(self, longest_tokens: int) -> int:
        """Block-table columns a step reaching ``longest_tokens`` passes (``inputs.table_width``)."""
        return table_width(min(longest_tokens, self.cfg.max_model_len), self.max_blocks, self.caches.block_size,
                           self.shapes.trim_context)

    def host_lengths(self, lengths: Iterable[int]) -> tuple[int, ...] | None:
        """KV lengths as host ints for attention that reads them (``model.takes_host_lengths``), else None."""
        return tuple(lengths) if self.takes_host_lengths else None

    def inert_batch(self, rows: int, k: int) -> DeviceBatch:
        return inert_batch(rows, k, self.max_blocks, self.device)

    def replay_args(self, batch: DeviceBatch, width: int, noise: spec_decode.RejectionNoise | None,
                    running: list[Sequence]) -> tuple[StepKey, tuple]:
        """The fused step's arguments for ``batch``, whose live rows are ``running`` (none: an inert batch)."""
        st = batch.sampling
        if noise is None:  # greedy: the graph takes noise inputs it does not read; one placeholder per shape
            noise = self._unused_noise.get((batch.rows, batch.k))
            if noise is None:
                noise = self._unused_noise[(batch.rows, batch.k)] = spec_decode.RejectionNoise(
                    torch.zeros(batch.rows, batch.k, device=self.device),
                    torch.ones(batch.rows, self.vocab_size, device=self.device))
        key = self.spec_graphs.key(batch.rows, batch.k, batch.mode, batch.logprobs)
        # where each verify block ends, past max_model_len too (its tokens there are inert): see PagedInputs
        lens_host = self.host_lengths(running[i].num_tokens + batch.k if i < len(running) else 0
                                      for i in range(batch.rows))
        # contiguous: a narrower view of the table would make the graph guard on its strides
        args = (batch.input_ids, batch.start, batch.num_draft, batch.block_table[:, :width].contiguous(),
                batch.live, st.temperature, st.top_k, st.top_p, st.greedy, noise.uniform, noise.exponential,
                self.row_limits(batch.rows, self.device), self.caches.target, self.caches.draft)
        return key, args + ((lens_host,) if lens_host is not None else ())

    def replay(self, batch: DeviceBatch, width: int, noise: spec_decode.RejectionNoise | None = None
               ) -> tuple[torch.Tensor, ...]:
        """One fused replay of an inert ``batch`` (warm-up, step timing): shapes, not data, set its cost."""
        key, args = self.replay_args(batch, width, noise, [])
        with suspended_if_compiled(self.backend):
            return self.spec_graphs(key, *args)
