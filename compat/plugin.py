"""vLLM general plugin: swaps the runner's MTP drafter class for the ascend_spec adapter.
:func:`register` (entry point ``ascend_spec_mtp``) installs the patch; the adapter decides when the runner builds it.
"""
from __future__ import annotations

import logging

from . import ascend, ascend_hook
from .drafter import build_adapter_class
from .runner_reach import WORKER_MODULE, patch_v2_runner, patch_worker
from .schedule_k import SCHEDULER_MODULE, patch_scheduler
from .shims_v2 import V2_RUNNER_MODULE
from .shims import Missing, raise_if_missing

logger = logging.getLogger(__name__)

RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
SEAM = "EagleProposer"


def register() -> None:
    """Rebind ``vllm.v1.worker.gpu_model_runner.EagleProposer`` (V1) and ``vllm.v1.worker.gpu.model_runner.
    init_speculator`` (V2) to build the adapter, check at engine start that the runner built ours, and let ours
    keep the scheduler's K per batch size (idempotent); on Ascend, patch vllm-ascend's drafter factory instead."""
    if ascend.on_ascend():
        ascend.install()
        return
    # V2's runner and the worker import later (and V2's only where Triton runs): patch them when they do.
    hook = ascend_hook.hook()
    if V2_RUNNER_MODULE not in hook.patches:
        hook.watch(V2_RUNNER_MODULE, patch_v2_runner)
        hook.watch(WORKER_MODULE, patch_worker)
        # the engine core's scheduler, where K per batch size is chosen (k_schedule: auto)
        hook.watch(SCHEDULER_MODULE, patch_scheduler)
    try:
        import vllm.v1.worker.gpu_model_runner as gmr
    except ImportError as e:
        raise_if_missing([Missing(RUNNER_MODULE, f"cannot be imported ({e})", "module.gpu_model_runner")],
                         "plugin registration")
        return
    base = getattr(gmr, SEAM, None)
    if not isinstance(base, type):
        raise_if_missing([Missing(f"{RUNNER_MODULE}.{SEAM}", "the runner no longer builds its drafter from this "
                                  "module global", "gpu_model_runner.EagleProposer")], "plugin registration")
    if getattr(base, "__ascend_spec_adapter__", False):
        return
    gmr.EagleProposer = build_adapter_class(base)
    logger.debug("ascend_spec: %s.%s -> adapter", RUNNER_MODULE, SEAM)
