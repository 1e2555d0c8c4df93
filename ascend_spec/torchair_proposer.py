"""``MtpTorchairProposer``: the MTP drafter on fixed-shape padded graphs, one per batch bucket.

The draft chain (``graph.steps.make_draft_step``) compiles once per bucket with the configured backend:
torchair on Ascend NPUs, torch.compile elsewhere, or eager. Persistent max-size buffers receive the real
rows; pad rows are inert (slot -1, seq_len 0) and their outputs are dropped. Every public method keeps
``MtpProposer``'s signature (a test checks ``inspect.signature``).
"""
from __future__ import annotations

import torch

from .config import SpeculativeConfig
from .graph.backends import Backend, get_backend
from .graph.attention import num_blocks_for
from .graph.buckets import BatchArg, BucketedGraph, warm_widths
from .graph.model import DeepseekV3ForCausalLM
from .proposer import MtpProposer
from .sync_counter import suspended_if_compiled

DRAFT_BATCH_ARGS = (BatchArg("input_ids", 0), BatchArg("positions", 0), BatchArg("hidden", 0.0),
                    BatchArg("sample_idx", 0), BatchArg("slot_mapping", -1), BatchArg("block_table", 0, width=True),
                    BatchArg("seq_lens", 0))


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

    def warmup(self, progress: bool = True) -> dict[int, float]:
        """Compile the draft graph(s) (verify layout, Q = 1 + K): one per bucket, largest first, where the backend
        compiles per shape. Backends that take trimmed tables replay widths from small (distinct from the warm-up
        batch size, so Dynamo keeps the two dimensions apart) to the full ``max_model_len`` (``warm_widths``)."""
        full = num_blocks_for(self.max_model_len)
        widths = warm_widths(full) if self.backend.shapes.trim_context else None
        example = self._inert_batch(self.graph.max_size, full)
        with torch.no_grad():
            return self.graph.warmup(example, (self.draft_cache,), progress=progress, widths=widths)

    def _run_draft(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                   sample_idx: torch.Tensor, slot_mapping: torch.Tensor, block_table: torch.Tensor,
                   seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if input_ids.shape[1] != 1 + self.num_speculative_tokens:
            # Prefill and the unpadded path have other query widths: the eager reference handles them.
            return super()._run_draft(input_ids, positions, hidden, sample_idx, slot_mapping, block_table, seq_lens)
        with torch.no_grad(), suspended_if_compiled(self.backend):
            return self.graph([input_ids, positions, hidden, sample_idx, slot_mapping, block_table, seq_lens],
                              (self.draft_cache,))
