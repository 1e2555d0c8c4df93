"""Our drafter into vLLM's V2 runner, and the check that every runner vLLM builds drafts with ours when asked.
:func:`patched_init_speculator` builds our adapter; :func:`check_reached` fails a start where ours is not reached.
"""
from __future__ import annotations

import functools
import logging
from types import ModuleType
from typing import Any, Callable

from .manifest import covers
from .settings import ADDITIONAL_CONFIG_KEY, METHODS, PluginSettings
from .shims import CompatError
from .shims_v2 import V2_MTP_CLASS, V2_RUNNER_MODULE, V2_SEAM, mtp_speculator_class, runner_drafter
from .speculator_v2 import build_speculator_class

logger = logging.getLogger(__name__)

#: the worker class whose ``load_model`` every vLLM GPU/CPU worker runs (CPUWorker inherits it)
WORKER_MODULE = "vllm.v1.worker.gpu_worker"
WORKER = "Worker"
#: the attribute our wrappers keep the wrapped function under (idempotent patching)
PATCHED = "__ascend_spec_wraps__"
REACHED = ("V1 (VLLM_USE_V2_MODEL_RUNNER=0: gpu_model_runner.EagleProposer) and V2 "
           f"(VLLM_USE_V2_MODEL_RUNNER=1: gpu.model_runner.{V2_SEAM} -> {V2_MTP_CLASS})")


def enabled_for(vllm_config: Any) -> bool:
    """Whether this engine asked for our drafter (the switch, and an MTP method). Bad settings raise here."""
    spec = vllm_config.speculative_config
    if spec is None:
        return False
    return PluginSettings.from_additional_config(vllm_config.additional_config).enabled and spec.method in METHODS


@functools.lru_cache(maxsize=None)
def _speculator_class(base: type) -> type:
    return build_speculator_class(base)


def patched_init_speculator(original: Callable[..., Any]) -> Callable[..., Any]:
    """``init_speculator`` that builds our adapter where V2 builds ``MTPSpeculator`` for an engine with an
    ``ascend_spec`` block (enabled: ours drafts; disabled: vLLM's does, through the adapter, which records stats)."""

    @functools.wraps(original)
    def init_speculator(vllm_config: Any, device: Any, *args: Any, **kwargs: Any) -> Any:
        speculator = original(vllm_config, device, *args, **kwargs)
        extra = vllm_config.additional_config
        if not (isinstance(extra, dict) and extra.get(ADDITIONAL_CONFIG_KEY) is not None):
            return speculator  # no ascend_spec block: vLLM's speculator as it ships
        base = mtp_speculator_class()
        if base is not None and type(speculator) is base:
            # ours, or (enabled: false) vLLM's drafting through the adapter, which then only records stats
            del speculator  # vLLM's, built only to learn which class this release picks
            return _speculator_class(base)(vllm_config, device)
        if enabled_for(vllm_config):
            raise CompatError(
                f"additional_config.{ADDITIONAL_CONFIG_KEY}.enabled=true, but vLLM's V2 model runner built "
                f"{type(speculator).__name__} for speculative_config.method="
                f"{vllm_config.speculative_config.method!r}; ours replaces {V2_MTP_CLASS} (one DeepSeek MTP "
                f"layer) only. Allowed: a model with one MTP layer, or {ADDITIONAL_CONFIG_KEY}.enabled: false")
        return speculator

    setattr(init_speculator, PATCHED, original)
    return init_speculator


def check_reached(vllm_config: Any, model_runner: Any, exempt: Callable[[Any], bool] | None = None) -> None:
    """One error at engine start when ours is enabled and the runner's drafter is not ours (``exempt(vllm_config)``:
    a model the platform keeps its own drafter for, with a warning)."""
    if not enabled_for(vllm_config) or (exempt is not None and exempt(vllm_config)):
        return
    kind, drafter = runner_drafter(model_runner)
    if drafter is None and vllm_config.parallel_config.pipeline_parallel_size > 1:
        return  # only the last pipeline stage drafts
    if getattr(drafter, "__ascend_spec_adapter__", False):
        return
    runner = f"{type(model_runner).__module__}.{type(model_runner).__name__}"
    raise CompatError(
        f"additional_config.{ADDITIONAL_CONFIG_KEY}.enabled=true, but the model runner {runner} "
        f"({kind or 'unknown'} runner) built {type(drafter).__name__} as its drafter: ours is not reached, and "
        f"vLLM's would draft in its place. Runners ascend_spec reaches: {REACHED}; or set "
        f"{ADDITIONAL_CONFIG_KEY}.enabled: false")


@covers("v2_speculator_seam", "v2_runner_absent")
def patch_v2_runner(module: ModuleType) -> None:
    """Rebind V2's ``init_speculator`` global (once), when V2's runner module imports: a release without it never
    does, and V1's seam is then the only one."""
    fn = getattr(module, V2_SEAM, None)
    if fn is not None and getattr(fn, PATCHED, None) is None:
        setattr(module, V2_SEAM, patched_init_speculator(fn))
        logger.debug("ascend_spec: %s.%s -> adapter", V2_RUNNER_MODULE, V2_SEAM)


def patch_worker(module: ModuleType, cls_name: str = WORKER, exempt: Callable[[Any], bool] | None = None) -> None:
    """``<cls_name>.load_model`` (vLLM's ``Worker``, vllm-ascend's ``NPUWorker``) followed by :func:`check_reached`
    (once)."""
    cls = getattr(module, cls_name, None)
    load = getattr(cls, "load_model", None)
    if load is None or getattr(load, PATCHED, None) is not None:
        return

    @functools.wraps(load)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = load(self, *args, **kwargs)
        check_reached(self.vllm_config, self.model_runner, exempt)
        return out

    setattr(load_model, PATCHED, load)
    cls.load_model = load_model
