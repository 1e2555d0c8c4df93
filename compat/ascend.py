"""The vllm-ascend route: our drafter as the MTP drafter of vllm-ascend's NPU model runner.
:func:`install` wraps vllm-ascend's drafter factory and its V2 runner's ``init_speculator`` to build ours when enabled.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
import sys
from types import ModuleType
from typing import Any, Callable


from . import ascend_hook, schedule_k
from .ascend_context import AscendNpuContextMixin
from .drafter import AscendSpecMtpMixin, build_adapter_class
from .runner_reach import patch_worker
from .manifest import covers
from .settings import METHODS, PluginSettings
from .shims import CompatError, Missing, call_with_supported, missing_methods, raise_if_missing

logger = logging.getLogger("vllm.ascend_spec.ascend")  # manifest: ignore (our logger name)

FACTORY_MODULE = "vllm_ascend.spec_decode"
FACTORY = "get_spec_decode_method"
RUNNER_MODULE = "vllm_ascend.worker.model_runner_v1"
WORKER_MODULE = "vllm_ascend.worker.worker"
WORKER = "NPUWorker"
PROPOSER_MODULE = "vllm_ascend.spec_decode.eagle_proposer"
PROPOSER = "AscendEagleProposer"
#: where ``init_speculator`` lives: v0.23.0 in the eagle submodule, from v0.24.0rc1 in the package
V2_SPECULATOR_MODULES = ("vllm_ascend.worker.v2.spec_decode", "vllm_ascend.worker.v2.spec_decode.eagle")
V2_SPECULATOR = "init_speculator"
V2_RUNNER_MODULE = "vllm_ascend.worker.v2.model_runner"
#: the Ascend runner's ``_propose`` keywords the adapter reads; the others are only forwarded on fallback
PROPOSE_KEYWORDS = ("target_token_ids", "target_positions", "target_hidden_states", "next_token_ids",
                    "token_indices_to_sample", "common_attn_metadata", "sampling_metadata")

_PATCHED = "__ascend_spec_patched__"


def on_ascend() -> bool:
    """True when vLLM resolved the Ascend platform (vllm-ascend's ``NPUPlatform``, device type ``npu``)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return getattr(current_platform, "device_type", None) == "npu"


def enabled_for(vllm_config: Any, method: str) -> bool:
    """Whether this engine asked for our drafter (the switch, and an MTP method). Bad settings raise here."""
    settings = PluginSettings.from_additional_config(vllm_config.additional_config)
    return settings.enabled and method in METHODS


# ------------------------------------------------------------------------------------------ the factory


def patched_factory(original: Callable[..., Any], adapter: Callable[[], type]) -> Callable[..., Any]:
    """``get_spec_decode_method`` that builds our adapter for an enabled MTP engine, else calls ``original``."""

    @functools.wraps(original)
    def get_spec_decode_method(method: str, vllm_config: Any, device: Any, runner: Any) -> Any:
        if enabled_for(vllm_config, method):
            if uses_other_mtp(vllm_config):
                logger.warning("ascend_spec drafter enabled, but this MTP model is not DeepSeek's (step3p5): "
                               "vllm-ascend's drafter is used")
            else:
                return adapter()(vllm_config, device, runner)
        return original(method, vllm_config, device, runner)

    setattr(get_spec_decode_method, _PATCHED, original)
    return get_spec_decode_method


def uses_other_mtp(vllm_config: Any) -> bool:
    """vllm-ascend routes Step-3.5's (and on main Gemma-4's) MTP to other drafters; ours drafts DeepSeek's only."""
    speculative_config = vllm_config.speculative_config
    probes = [getattr(speculative_config, p, None) for p in ("use_step3p5_mtp", "use_gemma4_mtp")]
    return any(bool(p()) for p in probes if callable(p))


def patched_speculator(original: Callable[..., Any]) -> Callable[..., Any]:
    """``init_speculator`` of vllm-ascend's V2 runner: for an enabled MTP engine, our adapter over the class
    ``original`` built (:func:`ascend_v2.adapter_for`), else what ``original`` built."""

    @functools.wraps(original)
    def init_speculator(vllm_config: Any, device: Any, *args: Any, **kwargs: Any) -> Any:
        speculator = original(vllm_config, device, *args, **kwargs)
        spec = vllm_config.speculative_config
        if spec is None or not enabled_for(vllm_config, spec.method):
            return speculator
        if uses_other_mtp(vllm_config):
            logger.warning("ascend_spec drafter enabled, but this MTP model is not DeepSeek's: vllm-ascend's "
                           "speculator is used")
            return speculator
        from .ascend_v2 import adapter_for

        cls = adapter_for(type(speculator))
        del speculator  # vllm-ascend's, built only to learn which class this release picks
        return cls(vllm_config, device)

    setattr(init_speculator, _PATCHED, original)
    return init_speculator


def _patch_global(module: ModuleType, name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    fn = getattr(module, name, None)
    if fn is None or getattr(fn, _PATCHED, None) is not None:
        return
    setattr(module, name, wrap(fn))
    logger.debug("ascend_spec: patched %s.%s", module.__name__, name)


def _patch_factory_module(module: ModuleType) -> None:
    _patch_global(module, FACTORY, lambda f: patched_factory(f, ascend_adapter_class))


def _rebind(module: ModuleType, name: str, sources: tuple[str, ...]) -> None:
    """A runner imported ``name`` by value: when it did so before the patch (it was imported before the hook),
    point it at the patched function of whichever source module it came from."""
    mine = getattr(module, name, None)
    for src in sources:
        ours = getattr(sys.modules.get(src), name, None)
        if ours is not None and mine is not None and mine is getattr(ours, _PATCHED, None):
            setattr(module, name, ours)
            logger.debug("ascend_spec: rebound %s.%s", module.__name__, name)


def _patch_runner_module(module: ModuleType) -> None:
    _rebind(module, FACTORY, (FACTORY_MODULE,))


@covers("ascend_v2_speculator_location")
def _patch_speculator_module(module: ModuleType) -> None:
    _patch_global(module, V2_SPECULATOR, patched_speculator)


@covers("ascend_v2_speculator_location")
def _patch_v2_runner_module(module: ModuleType) -> None:
    _rebind(module, V2_SPECULATOR, V2_SPECULATOR_MODULES)


def install() -> None:
    """Patch vllm-ascend's drafter factory, its V2 speculator and its worker's ``load_model`` now or when they are
    imported."""
    h = ascend_hook.hook()
    schedule_k.runner_passes_k = runner_passes_k
    if FACTORY_MODULE not in h.patches:
        h.watch(schedule_k.SCHEDULER_MODULE, schedule_k.patch_scheduler)  # vllm-ascend runs vLLM's scheduler
        h.watch(FACTORY_MODULE, _patch_factory_module)
        h.watch(RUNNER_MODULE, _patch_runner_module)
        for mod in V2_SPECULATOR_MODULES:
            h.watch(mod, _patch_speculator_module)
        h.watch(V2_RUNNER_MODULE, _patch_v2_runner_module)
        # after the model loads: an enabled engine whose runner did not build ours fails at start
        h.watch(WORKER_MODULE, functools.partial(patch_worker, cls_name=WORKER, exempt=uses_other_mtp))


# ------------------------------------------------------------------------------------------ the adapter


@functools.lru_cache(maxsize=None)
def _adapter_for(base: type) -> type:
    return build_ascend_adapter_class(base)


def ascend_adapter_class() -> type:
    """Our adapter on the installed vllm-ascend's ``AscendEagleProposer`` (built once per base class)."""
    try:
        base = getattr(importlib.import_module(PROPOSER_MODULE), PROPOSER)
    except (ImportError, AttributeError) as e:
        raise_if_missing([Missing(f"{PROPOSER_MODULE}.{PROPOSER}", f"cannot be imported ({e})",
                                  "AscendEagleProposer")], "vllm-ascend drafter")
        raise
    return _adapter_for(base)


#: Ascend runner calls the adapter relies on, and the parameters it handles (manifest items AscendEagleProposer.*)
ASCEND_PROPOSER_METHODS: dict[str, tuple[str, ...]] = {
    "_propose": PROPOSE_KEYWORDS,
    "prepare_next_token_ids_padded": ("sampled_token_ids", "requests", "gpu_input_batch"),
    "prepare_inputs_padded": ("common_attn_metadata", "spec_decode_metadata", "valid_sampled_tokens_count"),
    "load_model": (),
    "dummy_run": ("num_tokens",),
    "initialize_attn_backend": ("kv_cache_config",),
}


def probe_ascend_proposer_api(base: type) -> list[Missing]:
    """Check ``AscendEagleProposer``'s methods before an enabled adapter relies on them."""
    return missing_methods(base, ASCEND_PROPOSER_METHODS, PROPOSER, "AscendEagleProposer")


@covers("ascend_propose_num_spec_tokens")
def propose_k(num_speculative_tokens: int | None, default: int) -> int:
    """K for this step: main passes ``num_speculative_tokens`` to ``_propose``; up to v0.25.1rc1 it is the
    drafter's own ``num_speculative_tokens``."""
    return default if num_speculative_tokens is None else int(num_speculative_tokens)


@covers("ascend_propose_num_spec_tokens")
def runner_passes_k() -> bool:
    """Whether vllm-ascend's runner passes each step's K to the drafter's ``_propose`` (main); up to v0.25.1rc1 it
    does not, so ours keeps K fixed there (``k_schedule`` auto needs it)."""
    try:
        base = getattr(importlib.import_module(PROPOSER_MODULE), PROPOSER)
    except (ImportError, AttributeError):
        return False
    return "num_speculative_tokens" in inspect.signature(base._propose).parameters


@covers("ascend_propose_num_spec_tokens")
def their_propose_kwargs(theirs: Callable[..., Any], passed: dict[str, Any], k: int) -> dict[str, Any]:
    """The keywords for vllm-ascend's own ``_propose``: K added where it takes it (main), never where it does not."""
    if "num_speculative_tokens" in inspect.signature(theirs).parameters:
        return {**passed, "num_speculative_tokens": k}
    return passed


class AscendSpecNpuMixin(AscendNpuContextMixin, AscendSpecMtpMixin):
    """The Ascend runner's interface: ``_propose`` (its keywords), ``initialize_attn_backend(kv_cache_config,
    block_size)``, ``dummy_run`` (its keywords; the base class's inert draft once ours is built), its data-parallel
    sync; the 4-tuple ``prepare_inputs_padded`` stays vllm-ascend's (it prepares the metadata fallbacks use)."""

    #: vllm-ascend's MLA keeps the draft cache as nope ``[N, 128, 1, 512]`` and rope ``[N, 128, 1, 64]`` apart
    _ascend_kv_layout = "pair"
    #: a DSA draft layer: its SFA cache ``(k_nope, k_pe, indexer_k)`` at block 128, keys in the model dtype
    _sparse_cache_readable = True
    #: vllm-ascend's runners run their own step (its NPU sampler, its draft hand-over)
    _lean_k0_runner = False

    def _probe_api(self) -> list[Missing]:
        return probe_ascend_proposer_api(self.vllm_base)

    def initialize_attn_backend(self, kv_cache_config: Any, block_size: Any = None, *args: Any,
                                **kwargs: Any) -> None:
        if isinstance(block_size, int):
            self._ascend_block_size = block_size
        extra = () if block_size is None else (block_size,)
        super().initialize_attn_backend(kv_cache_config, *extra, *args, **kwargs)
        if self.ascend_enabled:
            # NPUModelRunner.initialize_kv_cache binds the KV cache before this call (every release): a layout
            # ours does not read (int8 indexer keys, a packed int8 latent) is one error at start
            self._bind_if_bound()

    def _refuse_unpaired_dp(self, moe: bool) -> None:
        dp = self.ascend_stats.dp_size
        if moe and dp > 1:
            raise CompatError(f"ascend_spec drafter on vllm-ascend: a MoE MTP layer with data_parallel_size={dp} is "
                              "not supported: vllm-ascend pads every rank's draft to the largest token count across "
                              "ranks, and our graphs run each rank's own bucket; use data_parallel_size=1 or "
                              "additional_config ascend_spec.enabled: false")

    @contextlib.contextmanager
    def _dp_sync(self, batch: int, query: int) -> Any:
        """vllm-ascend's drafter syncs once per draft and once per dummy run, through its runner (one all-reduce of
        the ranks' counts, none where its rule skips it): ours makes that one call, with our first pass's tokens."""
        if self.ascend_stats.dp_size > 1:
            sync_draft_across_dp(self.runner, self._ascend.forward_tokens(batch, query)[0])
            self.ascend_stats.dp_syncs += 1
        yield

    def _propose(self, *, target_token_ids: Any = None, target_positions: Any = None,
                 target_hidden_states: Any = None, next_token_ids: Any = None,
                 token_indices_to_sample: Any = None, common_attn_metadata: Any = None,
                 target_model_batch_desc: Any = None, sampling_metadata: Any = None,
                 mm_embed_inputs: Any = None, req_scheduled_tokens: Any = None, long_seq_metadata: Any = None,
                 num_prefill_reqs: int = 0, num_decode_reqs: int = 0, scheduler_output: Any = None,
                 num_scheduled_tokens: int = 0, num_rejected_tokens_gpu: Any = None,
                 num_speculative_tokens: int | None = None, **kwargs: Any) -> Any:
        passed = dict(target_token_ids=target_token_ids, target_positions=target_positions,
                      target_hidden_states=target_hidden_states, next_token_ids=next_token_ids,
                      token_indices_to_sample=token_indices_to_sample,
                      common_attn_metadata=common_attn_metadata, target_model_batch_desc=target_model_batch_desc,
                      sampling_metadata=sampling_metadata, mm_embed_inputs=mm_embed_inputs,
                      req_scheduled_tokens=req_scheduled_tokens, long_seq_metadata=long_seq_metadata,
                      num_prefill_reqs=num_prefill_reqs, num_decode_reqs=num_decode_reqs,
                      scheduler_output=scheduler_output, num_scheduled_tokens=num_scheduled_tokens,
                      num_rejected_tokens_gpu=num_rejected_tokens_gpu, **kwargs)
        k = propose_k(num_speculative_tokens, self.num_speculative_tokens)
        theirs = super()._propose
        passed = their_propose_kwargs(theirs, passed, k)
        return self._draft_or_delegate(
            k, target_token_ids, target_positions, target_hidden_states, next_token_ids, token_indices_to_sample,
            common_attn_metadata, sampling_metadata,
            self._ascend_only_reason(mm_embed_inputs, long_seq_metadata, num_prefill_reqs, num_decode_reqs),
            lambda: call_with_supported(theirs, **passed))

    @staticmethod
    def _ascend_only_reason(mm_embed_inputs: Any, long_seq_metadata: Any, num_prefill_reqs: int,
                            num_decode_reqs: int) -> str | None:
        if mm_embed_inputs is not None:
            return "multimodal"
        if long_seq_metadata is not None or num_prefill_reqs or num_decode_reqs:
            return "context_parallel"  # pcp/dcp split the tokens across ranks: vllm-ascend's path
        return None


def build_ascend_adapter_class(base: type) -> type:
    """Subclass vllm-ascend's ``AscendEagleProposer`` (``base``) into the adapter the NPU runner drives."""
    return build_adapter_class(base, AscendSpecNpuMixin, "AscendSpecNpuMtpProposer")


@covers("ascend_dp_sync")
def sync_draft_across_dp(npu_runner: Any, num_tokens: int) -> None:
    """The data-parallel sync vllm-ascend's drafter makes per draft (manifest item
    ``NPUModelRunner._sync_metadata_across_dp`` of the Ascend manifest)."""
    npu_runner._sync_metadata_across_dp(num_tokens, is_draft_model=True)
