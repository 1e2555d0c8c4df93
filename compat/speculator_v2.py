"""The adapter vLLM's V2 model runner builds as its MTP speculator (``vllm/v1/worker/gpu/``).
It subclasses the ``MTPSpeculator`` it replaces and drafts through our bucket graphs on V2's own batch layout.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

from ascend_spec.inputs import pad_ragged, table_width
from ascend_spec.proposer import DraftInputs

from .draft_core import DraftCoreMixin, fit_width
from .shims import CompatError, Missing, raise_if_missing
from .shims_v2 import (cudagraph_mode_none, probe_speculator_api, v2_draft_slots, v2_kv_group, v2_last_sampled_tokens,
                       v2_prefill_next_tokens)


class AscendSpecV2Mixin(DraftCoreMixin):
    """V2's adapter; :func:`build_speculator_class` puts it in front of vLLM's ``MTPSpeculator``."""

    def __init__(self, vllm_config: Any, device: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, device, *args, **kwargs)
        self._init_core(vllm_config, "v2")
        self._draft_k = self.num_speculative_steps
        self._draft_group = 0
        self._block_size = 0
        if self.ascend_enabled:
            raise_if_missing(self._probe_v2_api(), "V2 speculator interface")
            self._refuse_v2_dp_moe()

    def _draft_block_size(self) -> int:
        return self._block_size

    def _probe_v2_api(self) -> list[Missing]:
        return probe_speculator_api(self.vllm_base)

    def _refuse_v2_dp_moe(self) -> None:
        from .host_weights import config_from_vllm

        dp = self.ascend_stats.dp_size
        if dp > 1 and config_from_vllm(self.vllm_config).moe is not None:
            raise CompatError(f"ascend_spec drafter on vLLM's V2 model runner: a MoE MTP layer with "
                              f"data_parallel_size={dp} is not supported (V2 agrees every rank's MoE token counts "
                              "with the target's batch shape, our graphs run each rank's own bucket); allowed: "
                              "data_parallel_size=1, VLLM_USE_V2_MODEL_RUNNER=0 (V1 runner), or "
                              "additional_config ascend_spec.enabled: false")

    # -- lifecycle -------------------------------------------------------------------------
    def load_model(self, target_model: Any, *args: Any, **kwargs: Any) -> None:
        # vLLM's own load first: it registers the draft attention layer, so vLLM allocates its KV cache.
        super().load_model(target_model, *args, **kwargs)
        self._load_ours({"runner": "v2", "speculator": self.vllm_base.__name__})

    def set_attn(self, model_state: Any, kv_cache_config: Any, block_tables: Any, *args: Any, **kwargs: Any) -> None:
        super().set_attn(model_state, kv_cache_config, block_tables, *args, **kwargs)
        if not self.ascend_enabled:
            return
        names = sorted(self.draft_attn_layer_names)
        if names:
            self._draft_group, self._block_size = v2_kv_group(kv_cache_config, names[0])
        self._build_on_stand_in(names, kv_cache_config.num_blocks)

    def init_cudagraph_manager(self, cudagraph_mode: Any, *args: Any, **kwargs: Any) -> None:
        # Our bucket graphs replace vLLM's captures of its speculator; what vLLM still drafts itself runs eagerly.
        mode = cudagraph_mode_none() if self.ascend_enabled else cudagraph_mode
        super().init_cudagraph_manager(mode, *args, **kwargs)

    def capture(self, *args: Any, **kwargs: Any) -> None:
        if not self.ascend_enabled:
            super().capture(*args, **kwargs)

    # -- drafting --------------------------------------------------------------------------
    def propose(self, input_batch: Any, attn_metadata: Any, slot_mappings: Any, last_hidden_states: torch.Tensor,
                aux_hidden_states: Any, num_sampled: torch.Tensor, num_rejected: torch.Tensor,
                last_sampled: torch.Tensor, next_prefill_tokens: torch.Tensor, temperature: torch.Tensor,
                seeds: torch.Tensor, *args: Any, dummy_run: bool = False, is_profile: bool = False,
                num_speculative_tokens: int | None = None, **kwargs: Any) -> torch.Tensor:
        def theirs() -> torch.Tensor:
            return super(AscendSpecV2Mixin, self).propose(
                input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states, num_sampled,
                num_rejected, last_sampled, next_prefill_tokens, temperature, seeds, *args, dummy_run=dummy_run,
                is_profile=is_profile, num_speculative_tokens=num_speculative_tokens, **kwargs)

        return self._propose_v2(input_batch, slot_mappings, last_hidden_states, aux_hidden_states, num_sampled,
                                num_rejected, last_sampled, next_prefill_tokens, theirs, dummy_run=dummy_run,
                                is_profile=is_profile, k=num_speculative_tokens, mm_inputs=kwargs.get("mm_inputs"),
                                dp_synced=kwargs.get("dp_sync_state") is not None)

    def _propose_v2(self, input_batch: Any, slot_mappings: Any, last_hidden_states: torch.Tensor,
                    aux_hidden_states: Any, num_sampled: torch.Tensor, num_rejected: torch.Tensor,
                    last_sampled: torch.Tensor, next_prefill_tokens: torch.Tensor,
                    theirs: Callable[[], torch.Tensor], *, dummy_run: bool, is_profile: bool, k: int | None,
                    mm_inputs: Any, dp_synced: bool) -> torch.Tensor:
        """One V2 ``propose``: ours drafts it, or ``theirs`` (the speculator's own, with the runner's arguments);
        shared by every V2 runner's adapter (vLLM's, vllm-ascend's), whose ``propose`` signatures differ."""
        t0 = time.perf_counter()
        b = input_batch.num_reqs
        k = self._draft_k if k is None else k
        reason = self._fallback_reason(k, aux_hidden_states, input_batch, bool(is_profile), mm_inputs, dp_synced)
        spans = input_batch.num_scheduled_tokens[:b]  # host (numpy): the runner's own schedule
        decode = bool((spans == 1 + k).all())
        if reason is None and dummy_run:
            self._inert_draft(b)
            self.draft_tokens[:b].zero_()
            out = self.draft_tokens[:b]
        elif reason is None:
            width = max(int(spans.max()), 1 + k)
            with self._draft_context(b, width):
                draft = self._propose_ours(input_batch, slot_mappings, last_hidden_states, num_sampled,
                                           num_rejected, last_sampled, next_prefill_tokens, width, decode, k)
            # a step drafting fewer than K_max: the runner marks the columns past K unused (-1)
            self.draft_tokens[:b, :k] = draft
            out = self.draft_tokens[:b]
        else:
            out = theirs()
        st = self.ascend_stats
        if dummy_run:
            st.dummy_calls += 1
            st.dummy_seconds += time.perf_counter() - t0
        else:
            self._count_call(time.perf_counter() - t0, decode, reason)
        return out

    def _fallback_reason(self, k: int, aux_hidden_states: Any, input_batch: Any, is_profile: bool,
                         mm_inputs: Any, dp_synced: bool) -> str | None:
        """Why vLLM's own speculator must run this call, or None when ours drafts it."""
        if not self.ascend_enabled:
            return "disabled"
        if self._ascend is None or is_profile:
            return "not_built"  # the profile run sizes memory before the KV pool (and ours) exist
        if self._chain(k) is None:
            return "dynamic_k"  # a K of a schedule our chains were not built for
        if self.draft_logits is not None:
            return "probabilistic_draft"  # the rejection sampler reads the draft logits V2 caches
        if aux_hidden_states or mm_inputs is not None:
            return "multimodal" if mm_inputs is not None else "aux_hidden_states"
        if getattr(self, "pcp_manager", None) is not None:
            return "context_parallel"
        if getattr(self, "draft_watermarker", None) is not None or getattr(self, "acceptance_estimator", None):
            return "draft_logits_consumer"  # watermarking, adaptive verification read the draft distribution
        if input_batch.positions.dim() != 1:
            return "mrope"
        if self.ascend_stats.dp_size > 1 and not dp_synced:
            return "dp_unsynced"  # the runner agreed no shapes across ranks: the speculator's own would
        return None

    def _propose_ours(self, input_batch: Any, slot_mappings: Any, hidden: torch.Tensor, num_sampled: torch.Tensor,
                      num_rejected: torch.Tensor, last_sampled: torch.Tensor, next_prefill_tokens: torch.Tensor,
                      width: int, decode: bool, k: int) -> torch.Tensor:
        b, q = input_batch.num_reqs, 1 + k
        chain = self._chain(k)
        qsl = input_batch.query_start_loc[: b + 1].long()
        idx = input_batch.idx_mapping[:b].long()
        slots_flat = v2_draft_slots(slot_mappings, self._ascend_layer, self.block_tables, self._draft_group)
        # The token after each accepted prefix: the last sampled one, or a chunked prefill's next prompt token.
        next_ids = torch.where(num_sampled[:b] > 0, v2_last_sampled_tokens(last_sampled)[idx].long(),
                               v2_prefill_next_tokens(next_prefill_tokens)[idx].long())
        sample_in_span = qsl[1:] - qsl[:-1] - 1 - num_rejected[:b].long()
        if decode:
            n = b * q
            ids = input_batch.input_ids[:n].view(b, q).long()
            pos = input_batch.positions[:n].view(b, q).long()
            hid = hidden[:n].view(b, q, -1)
            slots = slots_flat[:n].view(b, q).long()
            if k == 0:
                held = self._hold_k0(next_ids, pos[:, 0], hid[:, 0], slots[:, 0], input_batch.req_ids)
                if held is not None:
                    return held
            if chain.graph.rows_for(b) is None:
                self._note_eager_decode(b)
            else:
                self.ascend_stats.graph_calls += 1
        else:
            ids, pos, hid, slots = pad_ragged(qsl, width, hidden.device, [
                (input_batch.input_ids, 0), (input_batch.positions, 0), (hidden, 0.0), (slots_flat, -1)])
            ids, pos, slots = ids.long(), pos.long(), slots.long()
            if chain.graph_serves(b, width):
                self.ascend_stats.graph_calls += 1
            else:
                self.ascend_stats.eager_calls += 1
        upper = input_batch.seq_lens_cpu_upper_bound[:b]  # host: never short of the exact device lengths
        block = self._block_size
        full = chain.table_width
        cols = table_width(int(upper.max()) + k, full, block, chain.backend.shapes.trim_context)
        lens_host = None
        if chain.model.takes_host_lengths:
            spans = input_batch.num_scheduled_tokens[:b].tolist()
            lens_host = tuple(u - n + ids.shape[1] for u, n in zip(upper.tolist(), spans))
        table = self.block_tables.input_block_tables[self._draft_group][:b]
        inputs = DraftInputs(
            target_token_ids=ids, target_positions=pos, target_hidden_states=hid, target_slot_mapping=slots,
            next_token_ids=next_ids, token_indices_to_sample=sample_in_span.clamp(0, ids.shape[1] - 1),
            block_table=fit_width(table, cols), seq_lens=input_batch.seq_lens[:b].long(), seq_lens_host=lens_host)
        return self._run_ours(inputs, k)


def build_speculator_class(base: type, mixin: type = AscendSpecV2Mixin,
                           name: str = "AscendSpecMtpSpeculator") -> type:
    """``name(mixin, base)``: the adapter as a subclass of V2's speculator class ``base`` (``MTPSpeculator``)."""
    return type(name, (mixin, base), {"vllm_base": base, "__module__": mixin.__module__})
