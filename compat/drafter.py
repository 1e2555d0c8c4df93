"""The adapter vLLM's V1 model runner builds as its MTP drafter: a subclass of the ``EagleProposer`` it replaces.
Enabled (``additional_config.ascend_spec``, method mtp/deepseek_mtp), it drafts with ``MtpTorchairProposer``.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from ascend_spec import spec_decode
from ascend_spec.graph.latent_cache import block_size_of
from ascend_spec.inputs import pad_ragged, table_width
from ascend_spec.proposer import DraftInputs

from .draft_core import LIVE, DraftCoreMixin, DrafterStats, StatsFile, fit_width, live_stats, logger
from .kv_layout import draft_block_size, draft_layer_names
from .lean_k0 import install_lean_k0_step
from .shims import (
    attn_fields,
    backup_next_token_ids,
    bind_runner,
    call_with_supported,
    detected_drift,
    discard_mask,
    host_seq_lens_upper_bound,
    probe_proposer_api,
    probe_runner,
    raise_if_missing,
)

__all__ = ["LIVE", "AscendSpecMtpMixin", "DrafterStats", "StatsFile", "build_adapter_class", "live_stats"]


class AscendSpecMtpMixin(DraftCoreMixin):
    """V1's adapter; :func:`build_adapter_class` puts it in front of vLLM's drafter class, which is known only at
    run time (its module moved between releases)."""

    #: vLLM's own V1 runner runs a K = 0 step lean (:mod:`.lean_k0`); a platform's runner keeps its own path
    _lean_k0_runner = True

    def __init__(self, vllm_config: Any, device: Any, runner: Any = None, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, device, runner, *args, **kwargs)
        bind_runner(self, runner)
        self._init_core(vllm_config, "v1")
        self._draft_k = self.num_speculative_tokens
        self._ascend_prev_host_ptr = None
        if self.ascend_enabled:
            raise_if_missing(self._probe_api(), "drafter interface")

    def _probe_api(self) -> list:
        return probe_proposer_api(self.vllm_base)

    def _draft_block_size(self) -> int:
        return draft_block_size(self)

    # -- lifecycle -------------------------------------------------------------------------
    def load_model(self, target_model: Any, *args: Any, **kwargs: Any) -> None:
        # vLLM's own load first: it registers the draft attention layer, so vLLM allocates its KV cache.
        call_with_supported(super().load_model, target_model, *args, **kwargs)
        if self.ascend_enabled:
            raise_if_missing(probe_runner(self.runner), "model runner state")
        self._load_ours(detected_drift(self.runner) if self.ascend_enabled else {})

    def initialize_attn_backend(self, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        call_with_supported(super().initialize_attn_backend, kv_cache_config, *args, **kwargs)
        if self.ascend_enabled:
            self._build_on_stand_in(draft_layer_names(self), kv_cache_config.num_blocks)
            # Under data parallel every rank's step makes the same collectives: no step of one rank is cut short
            if self._lean_k0_runner and self._k0_writes is not None and self.ascend_stats.dp_size == 1:
                self.ascend_stats.lean_k0_step = install_lean_k0_step(
                    self.runner, self._hold_lean_k0, self._takes_lean_k0, draft_layer_names(self)[0])

    def dummy_run(self, num_tokens: int, *args: Any, **kwargs: Any) -> Any:
        """The runner's dummy steps: the profile run (before the KV pool is sized, so before ours is built) and
        vLLM's CUDA-graph captures of its drafter (every rank captures alike) stay vLLM's drafter's. Once ours is
        built every other dummy step (an idle data-parallel rank's lockstep steps, vllm-ascend's captures) is an
        inert draft through our graphs, with the same data-parallel all-reduces a real draft makes."""
        t0 = time.perf_counter()
        try:
            if not self.ascend_enabled or self._ascend is None or kwargs.get("is_graph_capturing"):
                return call_with_supported(super().dummy_run, num_tokens, *args, **kwargs)
            q = 1 + self._ascend.num_speculative_tokens
            self._inert_draft(int(kwargs.get("num_reqs") or num_tokens // q))
            return None
        finally:
            self.ascend_stats.dummy_calls += 1
            self.ascend_stats.dummy_seconds += time.perf_counter() - t0

    # -- bookkeeping -----------------------------------------------------------------------
    def prepare_next_token_ids_padded(self, sampled_token_ids: torch.Tensor, requests: Any,
                                      gpu_input_batch: Any, discard_request_mask: Any = None,
                                      *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.ascend_enabled:
            return super().prepare_next_token_ids_padded(sampled_token_ids, requests, gpu_input_batch,
                                                         discard_request_mask, *args, **kwargs)
        num_reqs = sampled_token_ids.shape[0]
        num_discarded = args[0] if args else kwargs.get("num_discarded_requests")
        if discard_request_mask is None:  # vllm-ascend's name for the index buffer
            discard_request_mask = kwargs.get("discard_request_indices")
        mask = discard_mask(discard_request_mask, num_reqs, num_discarded, device=sampled_token_ids.device)
        backup = backup_next_token_ids(requests, gpu_input_batch, num_reqs).to(sampled_token_ids.device)
        if self.ascend_settings.collect_stats:
            self._record_optimistic(requests, gpu_input_batch, num_reqs)
        next_ids, count = spec_decode.prepare_next_token_ids_padded(
            sampled_token_ids, mask, backup, self._ascend_model.cfg.vocab_size)
        return next_ids.to(torch.int32), count

    def _record_optimistic(self, requests: Any, input_batch: Any, num_reqs: int) -> None:
        upper = host_seq_lens_upper_bound(self.runner, num_reqs)
        for i in range(num_reqs):
            if requests[input_batch.req_ids[i]].get_token_id(int(upper[i]) - 1) == -1:
                self.ascend_stats.reqs_placeholder_at_optimistic += 1

    # -- drafting --------------------------------------------------------------------------
    def propose(self, num_speculative_tokens: int | None = None, target_token_ids: Any = None,
                target_positions: Any = None, target_hidden_states: Any = None, next_token_ids: Any = None,
                token_indices_to_sample: Any = None, common_attn_metadata: Any = None,
                sampling_metadata: Any = None, **kwargs: Any) -> torch.Tensor:
        k = self.num_speculative_tokens if num_speculative_tokens is None else num_speculative_tokens
        theirs = super().propose
        # Forward what the runner passed, unchanged: runner and base class come from the same release.
        return self._draft_or_delegate(
            k, target_token_ids, target_positions, target_hidden_states, next_token_ids, token_indices_to_sample,
            common_attn_metadata, sampling_metadata, None,
            lambda: theirs(num_speculative_tokens=num_speculative_tokens, target_token_ids=target_token_ids,
                           target_positions=target_positions, target_hidden_states=target_hidden_states,
                           next_token_ids=next_token_ids, token_indices_to_sample=token_indices_to_sample,
                           common_attn_metadata=common_attn_metadata, sampling_metadata=sampling_metadata,
                           **kwargs))

    def _live_request_ids(self) -> Any:
        return self.runner.requests  # V1's request states by id: an ended request's is gone

    def _takes_lean_k0(self, batch: int) -> bool:
        """Whether :meth:`_hold_lean_k0` holds a K = 0 step of ``batch`` rows."""
        return self._fallback_reason(0, None, None) is None and self._k0_writes.takes(batch)

    def _hold_lean_k0(self, next_token_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                      slot_mapping: torch.Tensor, plain: bool) -> torch.Tensor | None:
        """The runner's lean K = 0 step (:mod:`.lean_k0`): this step's draft cache entries held, ``[B, 0]`` drafts;
        None where ours would not draft the step (the runner's own path asks then). ``plain``: the runner ran the
        step through its non-speculative branches."""
        if self._fallback_reason(0, positions, None) is not None:  # mrope positions among its reasons
            return None
        t0 = time.perf_counter()
        b = next_token_ids.shape[0]
        with self._draft_context(b, 1):  # a change of batch flushes the held writes through the K = 0 chain
            drafts = self._hold_k0(next_token_ids, positions, hidden, slot_mapping, self.runner.input_batch.req_ids)
        if drafts is not None:
            self.ascend_stats.k0_lean_steps += 1
            self.ascend_stats.k0_plain_steps += plain
            self._count_call(time.perf_counter() - t0, True, None)
        return drafts

    def _draft_or_delegate(self, k: int, target_token_ids: Any, target_positions: Any,
                           target_hidden_states: Any, next_token_ids: Any, token_indices_to_sample: Any,
                           common_attn_metadata: Any, sampling_metadata: Any, extra_reason: str | None,
                           delegate: Any) -> torch.Tensor:
        """Draft with ours, or call ``delegate()`` (the base class's own drafting) and count why."""
        t0 = time.perf_counter()
        f = attn_fields(common_attn_metadata)
        decode = f.max_query_len == 1 + k and f.num_actual_tokens == f.num_reqs * (1 + k)
        reason = self._fallback_reason(k, target_positions, sampling_metadata)
        if reason is None:
            reason = extra_reason
        if reason is None:
            width = max(f.max_query_len, 1 + k)
            with self._dp_sync(f.num_reqs, width), self._draft_context(f.num_reqs, width):
                out = self._propose_ascend(k, target_token_ids, target_positions, target_hidden_states,
                                           next_token_ids, token_indices_to_sample, f, decode)
        else:
            out = delegate()
        self._count_call(time.perf_counter() - t0, decode, reason)
        return out

    def _fallback_reason(self, k: int, target_positions: Any, sampling_metadata: Any) -> str | None:
        """Why vLLM's own propose must run this call, or None when ours drafts it."""
        if not self.ascend_enabled:
            return "disabled"
        if self._ascend is None:
            return "not_built"
        if self._chain(k) is None:
            return "dynamic_k"  # a K of a schedule our chains were not built for
        if target_positions is not None and target_positions.dim() != 1:
            return "mrope"
        probabilistic = getattr(self.speculative_config, "draft_sample_method", "greedy") != "greedy"
        if probabilistic and sampling_metadata is not None and not sampling_metadata.all_greedy:
            return "probabilistic_draft"
        return None

    def _propose_ascend(self, k: int, target_token_ids: torch.Tensor, target_positions: torch.Tensor,
                        target_hidden_states: torch.Tensor, next_token_ids: torch.Tensor,
                        token_indices_to_sample: torch.Tensor | None, f: Any, decode: bool) -> torch.Tensor:
        b, q = f.num_reqs, 1 + k
        dev = target_hidden_states.device
        chain = self._chain(k)
        qsl = f.query_start_loc[: b + 1].long()
        tis = (qsl[1:] - 1) if token_indices_to_sample is None else token_indices_to_sample[:b].long()
        if self.ascend_settings.collect_stats:
            self._record_host_buffer(b, f)
            self.ascend_stats.rows_sampled_outside += int((tis < qsl[:-1]).sum())
        if decode:
            # Every request verifies 1 + K tokens: the flat batch is already [B, Q]; reshape, no host reads.
            n = b * q
            ids = target_token_ids[:n].view(b, q).long()
            pos = target_positions[:n].view(b, q).long()
            hidden = target_hidden_states[:n].view(b, q, -1)
            slots = f.slot_mapping[:n].view(b, q).long()
            sample_idx = (tis - qsl[:-1]).clamp(0, q - 1)
            if k == 0:
                held = self._hold_k0(next_token_ids[:b].long(), pos[:, 0], hidden[:, 0], slots[:, 0],
                                     self.runner.input_batch.req_ids)
                if held is not None:
                    return held
            if chain.graph.rows_for(b) is None:
                self._note_eager_decode(b)
            else:
                self.ascend_stats.graph_calls += 1
        else:
            # Prefill, mixed, or vLLM's unpadded decode (rejected tokens compacted away: spans of at most 1 + K):
            # repack ragged -> [B, W] with inert padding (slot -1, token 0) on device, W at least 1 + K so that an
            # unpadded decode batch replays the decode graph's width (no host read, no new shape).
            width = max(f.max_query_len, q)
            ids, pos, hidden, slots = pad_ragged(qsl, width, dev, [
                (target_token_ids, 0), (target_positions, 0), (target_hidden_states, 0.0), (f.slot_mapping, -1)])
            ids, pos, slots = ids.long(), pos.long(), slots.long()
            sample_idx = (tis - qsl[:-1]).clamp(0, width - 1)
            if chain.graph_serves(b, width):
                self.ascend_stats.graph_calls += 1
            else:
                self.ascend_stats.eager_calls += 1
        block = block_size_of(chain.draft_cache)
        full = chain.table_width
        # Context is data: on backends that compile a dynamic width the table covers the live blocks only
        # (the chained drafts write up to max_seq_len + K - 1), so a step costs what the context costs.
        width = table_width(f.max_seq_len + k, full, block, chain.backend.shapes.trim_context)
        # Attention that reads host KV lengths (torch_npu's) gets the runner's host ones, optimistic under async
        # scheduling as vllm-ascend's own drafter passes them (an upper bound, never a read of the device's),
        # each aligned to its row's query block: a span right-padded to the batch's width ends that much later.
        lens_host = None
        if chain.model.takes_host_lengths:
            spans = (f.query_start_loc_cpu[1: b + 1] - f.query_start_loc_cpu[:b]).tolist()
            upper = host_seq_lens_upper_bound(self.runner, b).tolist()
            lens_host = tuple(u - n + ids.shape[1] for u, n in zip(upper, spans))
        inputs = DraftInputs(
            target_token_ids=ids, target_positions=pos, target_hidden_states=hidden, target_slot_mapping=slots,
            next_token_ids=next_token_ids[:b].long(), token_indices_to_sample=sample_idx,
            block_table=fit_width(f.block_table_tensor[:b], width), seq_lens=f.seq_lens[:b].long(),
            seq_lens_host=lens_host)
        draft = self._run_ours(inputs, k)
        if self.ascend_settings.collect_stats:
            self._check_host_buffer_after(b)
        return draft

    def _record_host_buffer(self, b: int, f: Any) -> None:
        buf = getattr(self.runner, "optimistic_seq_lens_cpu", None)
        upper = host_seq_lens_upper_bound(self.runner, b)
        if bool((upper > f.seq_lens[:b].to(upper.device, upper.dtype)).any()):
            self.ascend_stats.steps_optimistic_ahead += 1
        if buf is not None:
            ptr = buf.data_ptr()
            if ptr == self._ascend_prev_host_ptr:
                self.ascend_stats.host_buffer_reused += 1
            self._ascend_prev_host_ptr = ptr
        self._host_snapshot = upper

    def _check_host_buffer_after(self, b: int) -> None:
        if not torch.equal(host_seq_lens_upper_bound(self.runner, b), self._host_snapshot):
            self.ascend_stats.host_buffer_mutated += 1



def build_adapter_class(base: type, mixin: type = AscendSpecMtpMixin,
                        name: str = "AscendSpecMtpProposer") -> type:
    """``name(mixin, base)``: the adapter as a subclass of vLLM's drafter class ``base`` (``EagleProposer``), which
    vLLM's runner checks with ``isinstance``."""
    return type(name, (mixin, base), {"vllm_base": base, "__module__": mixin.__module__})
