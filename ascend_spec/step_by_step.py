"""The step-by-step decode path (``fused_step=False``, and batches the fused graph does not serve): the target graph,
sampling and the draft graph as separate calls, each step's inputs built on the host and its drafts read back.
"""
from __future__ import annotations

import torch

from . import spec_decode
from .inputs import DeviceBatch, verify_inputs
from .metrics import RunStats
from .proposer import DraftInputs
from .requests import Sequence, StepOutput, drafts_fit, step_tokens
from .runner_parts import RunnerParts
from .sampling import SamplingTensors, row_logprobs, sample, top_logprobs
from .sync_counter import counted_into, suspended_if_compiled


class StepByStep:
    def __init__(self, parts: RunnerParts) -> None:
        self.parts = parts
        #: each request's next drafts, where the last step that drafted them was fused (kept on device there)
        self.pending_drafts: dict[int, list[int]] = {}

    def forget(self, req_id: int) -> None:
        """A request is prefilled anew (preempted): its drafts are void."""
        self.pending_drafts.pop(req_id, None)

    def take_drafts(self, batch: DeviceBatch) -> None:
        """Leaving the fused path: the drafts ``batch`` holds on device, for the step-by-step steps to read."""
        self.pending_drafts = {rid: row[1: 1 + batch.k] for rid, row in
                               zip(batch.req_ids, batch.input_ids[: len(batch.req_ids)].tolist())}

    def step(self, running: list[Sequence], generator: torch.Generator | None, stats: RunStats) -> StepOutput:
        r = self.parts
        for seq in running:
            if seq.req_id in self.pending_drafts:
                seq.draft_ids = self.pending_drafts.pop(seq.req_id)
        dev = r.device
        k_max = r.k_max
        q = 1 + k_max
        max_len = r.cfg.max_model_len
        width = r.width_for(max(step_tokens(s.num_tokens, k_max) for s in running))
        input_ids, positions, slots, table, seq_lens = verify_inputs(running, k_max, width, max_len,
                                                                     r.caches.block_size, dev)
        num_draft = [drafts_fit(s.num_tokens, k_max, max_len) for s in running]
        num_draft_t = torch.tensor(num_draft, dtype=torch.long, device=dev)
        b = len(running)
        lens_host = r.host_lengths(s.num_tokens - 1 + q for s in running)  # see RunnerParts.replay_args
        st = SamplingTensors.from_params([s.params for s in running], dev)

        with torch.no_grad(), counted_into(stats, r.count_host_syncs):
            with suspended_if_compiled(r.backend):
                hidden, logits = r.target_graph([input_ids, positions, slots, table, seq_lens],
                                                (r.caches.target,), host_lengths=lens_host)
            if r.proposer is None:
                sampled = sample(logits[:, 0], st, generator).view(b, 1)
                valid = torch.ones(b, dtype=torch.long, device=dev)
                drafts = None
            else:
                sampled = spec_decode.rejection_sample(input_ids[:, 1:], num_draft_t, logits, st, None, generator)
                # No request is ever discarded here (no chunked prefill); the backup is the last known
                # token, i.e. token_ids[num_tokens_no_spec - 1], already on device as input_ids[:, 0].
                discard = torch.zeros(b, dtype=torch.bool, device=dev)
                next_ids, valid = r.proposer.prepare_next_token_ids_padded(sampled, discard, input_ids[:, 0])
                drafts = self._draft(input_ids, positions, hidden, slots, table, seq_lens, next_ids, valid,
                                     lens_host)
        n_logprobs = max((s.params.logprobs or 0 for s in running), default=0)
        want_logprobs = any(s.params.logprobs is not None for s in running)
        lp = top_logprobs(logits[:, : sampled.shape[1]], sampled, n_logprobs) if want_logprobs else None
        # The step's transfers: tokens, valid counts and the next drafts for bookkeeping (and logprobs).
        with counted_into(stats, r.count_host_syncs, transfers=True):
            lp_h = [t.tolist() for t in lp] if lp is not None else None
            sampled_h, valid_h = sampled.tolist(), valid.tolist()
            drafts_h = drafts.tolist() if drafts is not None else None
        tokens = [sampled_h[i][: valid_h[i]] for i in range(b)]
        logprobs = row_logprobs([s.params.logprobs for s in running], tokens, lp_h) if lp_h is not None else None
        return StepOutput(tokens, num_draft, k_max, logprobs, drafts_h)

    def _draft(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, slots: torch.Tensor,
               table: torch.Tensor, seq_lens: torch.Tensor, next_ids: torch.Tensor, valid: torch.Tensor,
               lens_host: tuple[int, ...] | None) -> torch.Tensor:
        proposer, spec = self.parts.proposer, self.parts.spec
        assert proposer is not None and spec is not None
        sample_idx = spec_decode.sample_indices_in_padded_rows(valid)
        if spec.disable_padded_drafter_batch:  # rejected tokens dropped, on device at the same width
            input_ids, positions, hidden, slots, seq_lens = spec_decode.compact_rejected(
                input_ids, positions, hidden, slots, seq_lens, sample_idx)
        # unpadded: the verify's lengths still bound the compacted rows' (see graph.mla_kernels.npu_mla)
        return proposer.propose(DraftInputs(input_ids, positions, hidden, slots, next_ids, sample_idx, table,
                                            seq_lens, lens_host))
