"""``MtpTorchairProposer``: the graph-mode MTP drafter on every backend (the name is the product's public one).
It replays the draft chain on fixed-shape padded graphs, one per batch bucket, and drafts prompt chunks too.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .config import DEFAULT_PREFILL_QUERY_WIDTHS, SpeculativeConfig
from .graph.backends import Backend, get_backend
from .graph.latent_cache import LatentCache, cache_tensors
from .graph.buckets import BatchArg, BucketedGraph, WarmStep, run_warm_steps, warm_widths
from .graph.model import DeepseekV3ForCausalLM
from .proposer import MtpProposer
from .sync_counter import suspended_if_compiled

DRAFT_BATCH_ARGS = (BatchArg("input_ids", 0, query=True), BatchArg("positions", 0, query=True),
                    BatchArg("hidden", 0.0, query=True), BatchArg("sample_idx", 0),
                    BatchArg("slot_mapping", -1, query=True), BatchArg("block_table", 0, width=True),
                    BatchArg("seq_lens", 0), BatchArg("max_len", 0))


class MtpTorchairProposer(MtpProposer):
    def __init__(self, model: DeepseekV3ForCausalLM, spec: SpeculativeConfig, max_model_len: int,
                 draft_cache: LatentCache, *, backend: Backend | None = None,
                 batch_sizes: list[int] | None = None,
                 prefill_widths: Sequence[int] = DEFAULT_PREFILL_QUERY_WIDTHS,
                 num_speculative_tokens: int | None = None) -> None:
        self.backend = backend or get_backend("auto", cache_tensors(draft_cache)[0].device)
        self.batch_sizes = sorted(batch_sizes or [1, 2, 4, 8])
        #: query widths (tokens per request) prefill and mixed batches replay a graph for, besides 1 + K
        self.prefill_widths = tuple(prefill_widths)
        super().__init__(model, spec, max_model_len, draft_cache, num_speculative_tokens)

    def load_model(self, model: DeepseekV3ForCausalLM) -> None:
        model.use_backend(self.backend)
        super().load_model(model)
        widths = {1 + self.num_speculative_tokens, *self.prefill_widths}
        self.graph = BucketedGraph(self.backend, self._draft_fn, "draft", self.batch_sizes, DRAFT_BATCH_ARGS,
                                   query_widths=sorted(widths), host_lengths=model.takes_host_lengths)

    def graph_serves(self, batch: int, query: int) -> bool:
        """Whether a draft of ``batch`` requests × ``query`` tokens replays a compiled graph (else eager): decode
        (1 + K) and prefill chunks up to the widest ``prefill_widths``, batches up to the largest bucket."""
        return self.graph.serves(batch, query)

    def forward_tokens(self, batch: int, query: int) -> tuple[int, int]:
        """Tokens the draft of ``batch`` requests × ``query`` tokens runs per forward pass: the first pass (the
        graph's rows × width, or the call's own where it runs eagerly) and each chained step 2..K (one per row)."""
        first = self.graph.tokens_for(batch, query)
        rows = self.graph.rows_for(batch) if self.graph.serves(batch, query) else None
        return first, rows or batch

    def warm_steps(self, why: str = "the draft chain") -> list[WarmStep]:
        """The draft graph(s)' warm-up plan: one per bucket, largest first, where the backend compiles per shape,
        and per query width where a graph replays one shape (1 + K and each prefill width). Backends that take
        trimmed tables replay widths from small (distinct from the warm-up batch size, so Dynamo keeps the two
        dimensions apart) to the full ``max_model_len`` (``warm_widths``); with a dynamic query axis, prefill
        widths too (distinct from the other two dimensions)."""
        full = self.table_width
        q = 1 + self.num_speculative_tokens
        # The first compile sees rows, query and table width: distinct sizes, so Dynamo gives each its own symbol.
        widths = warm_widths(full, smallest=max(3, q + 1)) if self.backend.shapes.trim_context else None
        largest = self.graph.query_widths[-1]
        queries = ([q + 2, largest] if largest > q + 2 else None) if self.graph.query_dynamic else None
        example = self._inert_batch(self.graph.max_size, full)
        return self.graph.warm_steps(example, (self.draft_cache,), widths=widths, queries=queries, why=why)

    def warmup(self, progress: bool = True) -> dict[str, float]:
        """Compile the draft graph(s) (:meth:`warm_steps`); seconds per graph."""
        return run_warm_steps(self.warm_steps(), progress, desc="compile draft")

    def _run_draft(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                   sample_idx: torch.Tensor, slot_mapping: torch.Tensor, block_table: torch.Tensor,
                   seq_lens: torch.Tensor, max_len: torch.Tensor, seq_lens_host: tuple[int, ...] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        args = [input_ids, positions, hidden, sample_idx, slot_mapping, block_table, seq_lens, max_len]
        if self.graph.query_for(input_ids.shape[1]) is None:
            # Wider than every graph (a long prompt chunk): the eager reference.
            return super()._run_draft(*args, seq_lens_host=seq_lens_host)
        with torch.no_grad(), suspended_if_compiled(self.backend):
            return self.graph(args, (self.draft_cache,), host_lengths=seq_lens_host)
