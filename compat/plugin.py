"""vLLM general plugin: swaps the runner's MTP drafter class for the ascend_spec adapter.

Entry point ``ascend_spec_mtp = "ascend_spec.compat.plugin:register"`` in group ``vllm.general_plugins``
(pyproject.toml). vLLM calls :func:`register` once per process (main, engine core, worker) before the
model runner exists, and before this process can know the engine's configuration. So the patch is
installed unconditionally and the adapter decides when the runner constructs it: with
``additional_config={"ascend_spec": {"enabled": True}, "torchair_graph_config": {...}}`` (see
``compat/settings.py``) and method ``mtp``/``deepseek_mtp`` it drafts with ``MtpTorchairProposer``;
otherwise it is vLLM's ``EagleProposer`` unchanged. ``VLLM_PLUGINS`` (entry-point names) excludes it.

On the Ascend platform vllm-ascend's runner builds its drafter from its own factory: :func:`register` patches
that instead (``compat/ascend.py``) and leaves vLLM's global alone.

If the seam itself is gone (no ``EagleProposer`` global in the runner's module), :func:`register` raises
:class:`~ascend_spec.compat.shims.VllmApiMissing`; further probes run when an enabled adapter is built.
"""
from __future__ import annotations

import logging

from . import ascend, ascend_hook
from .drafter import build_adapter_class
from .runner_reach import WORKER_MODULE, patch_v2_runner, patch_worker
from .shims_v2 import V2_RUNNER_MODULE
from .shims import Missing, raise_if_missing

logger = logging.getLogger(__name__)

RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
SEAM = "EagleProposer"


def register() -> None:
    """Rebind ``vllm.v1.worker.gpu_model_runner.EagleProposer`` (V1) and ``vllm.v1.worker.gpu.model_runner.
    init_speculator`` (V2) to build the adapter, and check at engine start that the runner built ours (idempotent);
    on Ascend, patch vllm-ascend's drafter factory instead."""
    if ascend.on_ascend():
        ascend.install()
        return
    # V2's runner and the worker import later (and V2's only where Triton runs): patch them when they do.
    hook = ascend_hook.hook()
    if V2_RUNNER_MODULE not in hook.patches:
        hook.watch(V2_RUNNER_MODULE, patch_v2_runner)
        hook.watch(WORKER_MODULE, patch_worker)
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
