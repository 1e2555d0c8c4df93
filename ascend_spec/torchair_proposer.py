"""``MtpTorchairProposer``: the MTP drafter on fixed-shape padded graphs, one per batch bucket.

The draft chain (``graph.steps.make_draft_step``) compiles once per bucket with the configured backend:
torchair on Ascend NPUs, torch.compile elsewhere, or eager. Persistent max-size buffers receive the real
rows; pad rows are inert (slot -1, seq_len 0) and their outputs are dropped. Every public method keeps
``MtpProposer``'s signature (a test checks ``inspect.signature``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import SpeculativeConfig
from .graph.backends import Backend, get_backend
from .graph.attention import num_blocks_for
from .graph.buckets import BatchArg, BucketedGraph, warm_widths
from .graph.model import DeepseekV3ForCausalLM
from .proposer import MtpProposer
from .sync_counter import suspended_if_compiled

DRAFT_BATCH_ARGS = (BatchArg("input_ids", 0, query=True), BatchArg("positions", 0, query=True),
                    BatchArg("hidden", 0.0, query=True), BatchArg("sample_idx", 0),
                    BatchArg("slot_mapping", -1, query=True), BatchArg("block_table", 0, width=True),
                    BatchArg("seq_lens", 0))
#: the widest query (tokens per request: a prompt chunk) a graph drafts on backends with a dynamic query axis;
#: wider ones run the eager reference
MAX_GRAPH_QUERY = 512


def pad_query(args: list[torch.Tensor], width: int) -> list[torch.Tensor]:
    """Draft inputs with each row's query padded to ``width`` tokens by inert ones (token 0, position 0, hidden
    0, slot -1: they write no cache slot and no live token's key or output depends on them)."""
    ids, pos, hidden, sample_idx, slots, table, seq_lens = args
    extra = width - ids.shape[1]
    return [F.pad(ids, (0, extra)), F.pad(pos, (0, extra)), F.pad(hidden, (0, 0, 0, extra)), sample_idx,
            F.pad(slots, (0, extra), value=-1), table, seq_lens]


class MtpTorchairProposer(MtpProposer):
    def __init__(self, model: DeepseekV3ForCausalLM, spec: SpeculativeConfig, max_model_len: int,
                 draft_cache: torch.Tensor, *, backend: Backend | None = None,
                 batch_sizes: list[int] | None = None) -> None:
        self.backend = backend or get_backend("auto", draft_cache.device)
        self.batch_sizes = sorted(batch_sizes or [1, 2, 4, 8])
        super().__init__(model, spec, max_model_len, draft_cache)

    def load_model(self, model: DeepseekV3ForCausalLM) -> None:
        model.use_backend(self.backend)
        super().load_model(model)
        self.graph = BucketedGraph(self.backend, self._draft_fn, "draft", self.batch_sizes, DRAFT_BATCH_ARGS)

    @property
    def query_is_dynamic(self) -> bool:
        """One compile serves every query width (prefill chunks too) where shapes are fully dynamic (inductor on
        CPU). Backends that replay one recorded shape per bucket (CUDA graphs, torchair's GE graphs) would record
        one per prompt length: they keep one width, 1 + K, and prefills run the eager reference."""
        return self.backend.shapes.dynamic_batch and self.backend.shapes.exact_batch

    def _query_compiles(self, query: int) -> bool:
        return query == 1 + self.num_speculative_tokens or (self.query_is_dynamic and query <= MAX_GRAPH_QUERY)

    def graph_serves(self, batch: int, query: int) -> bool:
        """Whether a draft of ``batch`` requests × ``query`` tokens replays a compiled graph (else eager)."""
        return self._query_compiles(query) and self.graph.bucket_for(batch) is not None

    def warmup(self, progress: bool = True) -> dict[int, float]:
        """Compile the draft graph(s) (verify layout, Q = 1 + K): one per bucket, largest first, where the backend
        compiles per shape. Backends that take trimmed tables replay widths from small (distinct from the warm-up
        batch size, so Dynamo keeps the two dimensions apart) to the full ``max_model_len`` (``warm_widths``);
        with a dynamic query axis, prefill widths too (distinct from the other two dimensions)."""
        full = num_blocks_for(self.max_model_len)
        q = 1 + self.num_speculative_tokens
        # The first compile sees rows, query and table width: distinct sizes, so Dynamo gives each its own symbol.
        widths = warm_widths(full, smallest=max(3, q + 1)) if self.backend.shapes.trim_context else None
        queries = [q + 2, MAX_GRAPH_QUERY] if self.query_is_dynamic else None
        example = self._inert_batch(self.graph.max_size, full)
        with torch.no_grad():
            return self.graph.warmup(example, (self.draft_cache,), progress=progress, widths=widths, queries=queries)

    def _run_draft(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                   sample_idx: torch.Tensor, slot_mapping: torch.Tensor, block_table: torch.Tensor,
                   seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        args = [input_ids, positions, hidden, sample_idx, slot_mapping, block_table, seq_lens]
        query = input_ids.shape[1]
        if not self._query_compiles(query):
            # Other query widths (prefill, the unpadded path) on a fixed-width backend: the eager reference.
            return super()._run_draft(*args)
        if query < 2:  # a dynamic dimension of size 1 would specialise the compile: one inert token more
            args = pad_query(args, 2)
        with torch.no_grad(), suspended_if_compiled(self.backend):
            return self.graph(args, (self.draft_cache,))
