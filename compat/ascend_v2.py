"""Our drafter as the MTP speculator of vllm-ascend's V2 model runner (``vllm_ascend/worker/v2``).
:func:`adapter_for` puts :class:`AscendSpecNpuV2Mixin` in front of the speculator class vllm-ascend picks.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from .ascend_context import AscendNpuContextMixin
from .manifest import covers
from .settings import ADDITIONAL_CONFIG_KEY
from .shims import CompatError, Missing, missing_methods
from .speculator_v2 import AscendSpecV2Mixin, build_speculator_class

#: vllm-ascend's V2 speculator classes ``init_speculator`` returns for DeepSeek's MTP, by release
V2_MTP_CLASSES = {"AscendMTPSpeculator": "vllm_ascend.worker.v2.spec_decode.mtp.speculator",
                  "AscendEagleSpeculator": "vllm_ascend.worker.v2.spec_decode.eagle.speculator"}
#: the speculator methods the V2 runner calls and the parameters the adapter handles (manifest AscendV2Speculator.*)
ASCEND_V2_METHODS: dict[str, tuple[str, ...]] = {
    "__init__": ("vllm_config", "device"),
    "load_model": (),
    "set_attn": ("model_state", "kv_cache_config", "block_tables"),
    "init_cudagraph_manager": ("cudagraph_mode",),
    "capture": (),
    "propose": ("input_batch", "attn_metadata", "slot_mappings", "last_hidden_states", "aux_hidden_states",
                "num_sampled", "num_rejected", "last_sampled", "next_prefill_tokens", "temperature", "seeds",
                "num_tokens_across_dp", "dummy_run", "skip_attn_for_dummy_run", "mm_inputs", "is_profile"),
}


@covers("ascend_v2_speculator")
def probe_ascend_v2_api(base: type) -> list[Missing]:
    """Check vllm-ascend's V2 speculator class before the adapter relies on it."""
    return missing_methods(base, ASCEND_V2_METHODS, base.__name__, "AscendV2Speculator")


class AscendSpecNpuV2Mixin(AscendNpuContextMixin, AscendSpecV2Mixin):
    """vllm-ascend's V2 speculator interface over :class:`AscendSpecV2Mixin`."""

    #: vllm-ascend's MLA keeps the draft cache as nope ``[N, 128, 1, 512]`` and rope ``[N, 128, 1, 64]`` apart
    _ascend_kv_layout = "pair"
    #: a DSA draft layer: its SFA cache ``(k_nope, k_pe, indexer_k)`` at block 128, keys in the model dtype
    _sparse_cache_readable = True
    _step_tokens_across_dp: Any = None

    def _probe_v2_api(self) -> list[Missing]:
        return probe_ascend_v2_api(self.vllm_base)

    def _refuse_v2_dp_moe(self) -> None:
        from .host_weights import config_from_vllm

        dp = self.ascend_stats.dp_size
        if dp > 1 and config_from_vllm(self.vllm_config).moe is not None:
            raise CompatError(f"ascend_spec drafter on vllm-ascend's V2 model runner: a MoE MTP layer with "
                              f"data_parallel_size={dp} is not supported (its runner pads every rank's MoE tokens "
                              "to the target step's counts across ranks, our graphs run each rank's own bucket); "
                              f"allowed: data_parallel_size=1, or {ADDITIONAL_CONFIG_KEY}.enabled: false")

    def _tokens_across_dp(self) -> Any:
        return self._step_tokens_across_dp

    @contextlib.contextmanager
    def _dp_sync(self, batch: int, query: int) -> Any:
        # vllm-ascend's V2 speculator makes no collective of its own: the runner hands every rank's counts over
        yield

    def propose(self, input_batch: Any, attn_metadata: Any, slot_mappings: Any, last_hidden_states: torch.Tensor,
                aux_hidden_states: Any, num_sampled: torch.Tensor, num_rejected: torch.Tensor,
                last_sampled: torch.Tensor, next_prefill_tokens: torch.Tensor, temperature: torch.Tensor,
                seeds: torch.Tensor, num_tokens_across_dp: torch.Tensor | None = None, dummy_run: bool = False,
                skip_attn_for_dummy_run: bool = False, mm_inputs: Any = None, is_profile: Any = None,
                **kwargs: Any) -> torch.Tensor:
        def theirs() -> torch.Tensor:
            return super(AscendSpecV2Mixin, self).propose(
                input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states, num_sampled,
                num_rejected, last_sampled, next_prefill_tokens, temperature, seeds,
                num_tokens_across_dp=num_tokens_across_dp, dummy_run=dummy_run,
                skip_attn_for_dummy_run=skip_attn_for_dummy_run, mm_inputs=mm_inputs, is_profile=is_profile,
                **kwargs)

        self._step_tokens_across_dp = num_tokens_across_dp
        try:
            return self._propose_v2(input_batch, slot_mappings, last_hidden_states, aux_hidden_states, num_sampled,
                                    num_rejected, last_sampled, next_prefill_tokens, theirs, dummy_run=dummy_run,
                                    is_profile=bool(is_profile), k=None, mm_inputs=mm_inputs,
                                    dp_synced=num_tokens_across_dp is not None)
        finally:
            self._step_tokens_across_dp = None


@functools.lru_cache(maxsize=None)
def _adapter_class(base: type) -> type:
    return build_speculator_class(base, AscendSpecNpuV2Mixin, "AscendSpecNpuMtpSpeculator")


@covers("ascend_v2_speculator")
def adapter_for(speculator_cls: type) -> type:
    """Our adapter over the V2 speculator class vllm-ascend's ``init_speculator`` picked for an enabled MTP engine;
    one error for a class we do not adapt."""
    if V2_MTP_CLASSES.get(speculator_cls.__name__) != speculator_cls.__module__:
        raise CompatError(
            f"additional_config.{ADDITIONAL_CONFIG_KEY}.enabled=true, but vllm-ascend's V2 model runner built "
            f"{speculator_cls.__module__}.{speculator_cls.__name__} as its MTP speculator; ours adapts "
            f"{' or '.join(V2_MTP_CLASSES)} only. Allowed: VLLM_USE_V2_MODEL_RUNNER=0 (vllm-ascend's V1 runner) "
            f"with enabled=true, or {ADDITIONAL_CONFIG_KEY}.enabled: false")
    return _adapter_class(speculator_cls)
