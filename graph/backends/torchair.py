"""torchair on Ascend NPUs: ``torchair.get_npu_backend(compiler_config=...)``.
Its ``CompilerConfig`` mirrors vllm-ascend's torchair graph mode; torchair is imported only when it is chosen.
"""
from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch

from ..mla_kernels import NPU_DEVICE_LENGTHS_OP
from ..paging import HOST_LENGTHS_SOURCES
from .base import BackendUnavailable, DynamicDims, GraphFn, ShapePolicy, clone_with_name
from .lint import GraphLint

#: torch_npu renamed ``reduce-overhead`` to ``npugraph_ex`` in newer releases; both select NPU graphs.
_MODE_ALIASES = {"max-autotune": "max-autotune", "reduce-overhead": "reduce-overhead", "npugraph_ex": "npugraph_ex"}


#: how the draft chain's steps 2..K give the attention op their KV lengths: ``upper_bound`` (host ints, the
#: verify's length plus the step, as vllm-ascend's padded drafter) or ``exact`` (the ``seq_lens`` tensor the step
#: computes on device, through torchair's Tensor-length op: GE mode only); ``auto``: exact in GE mode
DRAFT_KV_LENGTHS = ("auto", "upper_bound", "exact")
#: the only mode whose graphs take device lengths: npugraph_ex captures ACL kernels and re-feeds host lengths
#: on replay, and torchair's Tensor-length op has no kernel outside a GE graph
DEVICE_LENGTH_MODES = ("max-autotune",)


def resolve_draft_kv_lengths(setting: str, mode: str) -> str:
    """``upper_bound`` or ``exact`` for ``setting`` (one of ``DRAFT_KV_LENGTHS``) under torchair ``mode``; an
    ``exact`` that the mode cannot run, or an unknown setting, raises naming the allowed values."""
    if setting not in DRAFT_KV_LENGTHS:
        raise ValueError(f"draft_kv_lengths={setting!r}; allowed: {list(DRAFT_KV_LENGTHS)}")
    if setting == "auto":
        return "exact" if mode in DEVICE_LENGTH_MODES else "upper_bound"
    if setting == "exact" and mode not in DEVICE_LENGTH_MODES:
        raise ValueError(f"draft_kv_lengths='exact' with mode={mode!r}; allowed there: ['auto', 'upper_bound'] "
                         f"(exact device lengths need mode {list(DEVICE_LENGTH_MODES)})")
    return setting


@dataclass(frozen=True, slots=True)
class TorchairOptions:
    mode: str = "max-autotune"
    #: resolved: ``upper_bound`` or ``exact`` (:func:`resolve_draft_kv_lengths`)
    draft_kv_lengths: str = "exact"
    frozen_parameter: bool = True
    view_optimize: bool = True
    tiling_schedule_optimize: bool = False
    use_cached_graph: bool = False
    #: tensor parallel: collectives (HCCL all-reduce / all-gather) inside the graph
    distributed: bool = False


def compiler_config_settings(opts: TorchairOptions) -> dict[str, Any]:
    """The ``CompilerConfig`` attributes we set, as dotted paths → values (checked by the contract test)."""
    return {
        "mode": _MODE_ALIASES[opts.mode],
        "experimental_config.frozen_parameter": opts.frozen_parameter,
        "experimental_config.tiling_schedule_optimize": opts.tiling_schedule_optimize,
        "experimental_config.enable_view_optimize": opts.view_optimize,
    }


def apply_settings(config: Any, settings: dict[str, Any]) -> Any:
    for dotted, value in settings.items():
        *parents, leaf = dotted.split(".")
        target = config
        for p in parents:
            target = getattr(target, p)
        setattr(target, leaf, value)
    return config


def _import_torchair() -> Any:
    try:
        import torch_npu  # noqa: F401  (registers the NPU device; needs CANN)
        import torchair
    except Exception as exc:  # ImportError, or OSError for missing CANN libraries such as libhccl.so
        raise BackendUnavailable(
            "backend 'torchair' needs torch_npu with CANN on an Ascend NPU machine "
            f"(import failed: {exc!r}); use backend 'inductor' or 'eager' elsewhere") from exc
    return torchair


def _register_device_length_attention(torchair: Any) -> None:
    """torchair defines ``torch.ops.air.npu_fused_infer_attention_score`` when its module is first imported (what
    ``torchair.ops.npu_fused_infer_attention_score`` does on each call); import it here, outside any graph. A
    stand-in torchair (no module) declares the op itself."""
    if not hasattr(torch.ops.air, NPU_DEVICE_LENGTHS_OP) and isinstance(torchair, types.ModuleType):
        import importlib

        importlib.import_module(f"{torchair.__name__}.ops._npu_fused_infer_attention_score")


class TorchairBackend:
    name = "torchair"
    reuses_outputs = True
    #: GE graphs are compiled per shape: one per batch bucket, full-width block tables; the fused attention op
    #: reads each request's blocks up to its actual length.
    shapes = ShapePolicy(dynamic_batch=False, exact_batch=False, trim_context=False)
    attention_kernel = "npu"
    compile_regions = False

    def __init__(self, opts: TorchairOptions, graph_failure: str = "eager") -> None:
        self.opts = opts
        #: steps 2..K of the draft chain take their exact device lengths (``graph.model``)
        self.exact_draft_lengths = resolve_draft_kv_lengths(opts.draft_kv_lengths, opts.mode) == "exact"
        self.graph_failure = graph_failure
        self.lint = GraphLint(strict=graph_failure == "raise")
        self._torchair = _import_torchair()
        if opts.distributed:
            # Lower torch.distributed collectives in the graph to HCOM ops, as vllm-ascend's torchair mode did
            # under tensor parallel (verified against the wheel's sources only: tests/test_torchair_contract.py).
            self._torchair.patch_for_hcom()
        if self.exact_draft_lengths:
            _register_device_length_attention(self._torchair)
        config = apply_settings(self._torchair.CompilerConfig(), compiler_config_settings(opts))
        self._npu_backend = self._torchair.get_npu_backend(compiler_config=config)
        self._config = config

    def compile(self, fn: GraphFn, tag: str, dims: DynamicDims | None = None) -> GraphFn:
        if self.opts.use_cached_graph:
            return self._cache_compile(fn, tag)
        compiled = torch.compile(fn, backend=self.lint.wrap(self._npu_backend, tag), fullgraph=True, dynamic=False)
        return with_host_lengths_dynamic(compiled)

    def _cache_compile(self, fn: GraphFn, tag: str) -> GraphFn:
        """One ``cache_compile`` per batch size. It caches methods of modules only (``Only method can be cached
        now`` otherwise) and builds its own backend, so ``fn`` runs as a per-tag method of a holder module (its
        own code object: one Dynamo cache entry per size) and its first call traces it once through the lint."""
        holder = _GraphHolder(fn)
        method = types.MethodType(clone_with_name(_call_held, tag), holder)
        cached = with_host_lengths_dynamic(
            self._torchair.inference.cache_compile(method, config=self._config, dynamic=False))
        linted = False

        def graph(*args: Any) -> Any:
            nonlocal linted
            if not linted:
                lint_trace(self.lint, fn, tag, args)
                linted = True
            return cached(*args)

        return graph


class _GraphHolder(torch.nn.Module):
    def __init__(self, fn: GraphFn) -> None:
        super().__init__()
        self.fn = fn


def _call_held(self: _GraphHolder, *args: Any) -> Any:
    return self.fn(*args)


class _Traced(Exception):
    """Ends a trace-only compile once the lint has seen the graph."""


def lint_trace(lint: GraphLint, fn: GraphFn, tag: str, args: tuple[Any, ...]) -> None:
    """Trace ``fn`` on ``args`` as a torchair compile would and lint the graph, without running it."""

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        lint.check(gm, tag)
        raise _Traced

    traced = with_host_lengths_dynamic(torch.compile(clone_with_name(fn, f"{tag}_lint"), backend=backend,
                                                     fullgraph=True, dynamic=False))
    try:
        traced(*args)
    except Exception as exc:  # Dynamo wraps what a backend raises
        if not any(isinstance(e, _Traced) for e in (exc, exc.__cause__, getattr(exc, "inner_exception", None))):
            raise


def with_host_lengths_dynamic(compiled: GraphFn) -> GraphFn:
    """``compiled``, tracing the host KV lengths (``paging.HOST_LENGTHS_ARG``) as symbols: torchair feeds a
    SymInt input to the GE graph as a host input, where an int would be a constant (a graph per length).
    ``dynamic_sources`` is read when Dynamo traces, so it is set around every call."""

    def graph(*args: Any) -> Any:
        with torch.compiler.config.patch(dynamic_sources=HOST_LENGTHS_SOURCES):
            return compiled(*args)

    return graph
