"""torch.compile: plain inductor on CPU, ``reduce-overhead`` (CUDA graphs) on CUDA.
One compile per graph function, with the batch (and on CPU the block-table width) as dynamic dimensions.
"""
from __future__ import annotations

from typing import Any

import torch

from .aot_graphs import AotGraph, GraphStore, keep_portable_input_guards
from .base import DynamicDims, GraphFn, ShapePolicy
from .guards import keep_input_guards
from .lint import GraphLint


def mark_dims(args: tuple[Any, ...], dims: DynamicDims) -> None:
    for i in dims.batch:
        torch._dynamo.maybe_mark_dynamic(args[i], 0)
    for i in (*dims.width, *dims.query):
        torch._dynamo.maybe_mark_dynamic(args[i], 1)


class InductorBackend:
    name = "inductor"
    #: compiled layers are nested compile regions (torchair's GE converter has no such op; it compiles flat)
    compile_regions = True

    def __init__(self, device: torch.device, input_guards_only: bool = False, graph_failure: str = "eager") -> None:
        self.device = device
        self.graph_failure = graph_failure
        self.lint = GraphLint(strict=graph_failure == "raise")
        cuda = device.type == "cuda"
        self.mode = "reduce-overhead" if cuda else None
        # CUDA graph replays overwrite their static outputs.
        self.reuses_outputs = cuda
        self.shapes = (ShapePolicy(dynamic_batch=True, exact_batch=False, trim_context=False, min_batch=2) if cuda
                       else ShapePolicy(dynamic_batch=True, exact_batch=True, trim_context=True, min_batch=2))
        self.attention_kernel = "gather"
        #: MKL's sgemm is far faster with the few tokens of a decode step as the right operand (graph.layers.Linear)
        self.weight_left_matmul = not cuda
        # Guards on the arguments only (graph.backends.guards), where the caller's graphs take every per-call value
        # as one. CUDA keeps Dynamo's defaults (torch.compile takes ``mode`` or ``options``, not both).
        self.guard_filter = keep_input_guards if input_guards_only and not cuda else None
        #: where graphs are saved whole and loaded without tracing (``aot_graphs``; CPU only: CUDA graph trees
        #: over AOT-loaded graphs are unverified); the engine sets it when its compile cache is on
        self.store: GraphStore | None = None

    def _options(self) -> dict[str, Any] | None:
        # a new dict each call: torch.compile pops "guard_filter_fn" out of the one it is given
        return None if self.guard_filter is None else {"guard_filter_fn": self.guard_filter}

    def _compiled(self, fn: GraphFn, tag: str, options: dict[str, Any] | None) -> Any:
        """``torch.compile`` of ``fn``: inductor (with ``mode``) behind the graph lint, which sees the captured graph
        before lowering."""
        # dynamic=False: the dimensions marked from a graph's DynamicDims are its only dynamic ones. Dynamo's
        # automatic dynamic keys its profile by function, not by model: a second model's config values (a YaRN
        # factor) became graph inputs and failed the trace inside a layer's compile region (docs/design.md, "Shapes").
        backend = self.lint.wrap(torch._TorchCompileInductorWrapper(self.mode, None, False), tag)
        return torch.compile(fn, fullgraph=True, dynamic=False, backend=backend, options=options)

    def compile(self, fn: GraphFn, tag: str, dims: DynamicDims | None = None) -> GraphFn:
        if self.store is not None and self.mode is None:
            return self._compile_aot(fn, tag, dims)
        compiled = self._compiled(fn, tag, self._options())
        if dims is None:
            return self._new_generation_each_call(compiled, tag)

        def call(*args: Any) -> Any:
            # Any call may compile (a batch of one specialises its own graph): mark the dynamic dimensions of every
            # call's inputs (an attribute on each tensor; Dynamo reads it only when it compiles).
            mark_dims(args, dims)
            return compiled(*args)

        return self._new_generation_each_call(call, tag)

    def _compile_aot(self, fn: GraphFn, tag: str, dims: DynamicDims | None) -> GraphFn:
        assert self.store is not None

        def make_compiled(f: GraphFn) -> Any:
            return self._compiled(f, tag, {"guard_filter_fn": keep_portable_input_guards})

        return AotGraph(fn, tag, dims, self.store, self.lint, make_compiled, mark_dims)

    def _new_generation_each_call(self, compiled: GraphFn, tag: str) -> GraphFn:
        """On CUDA every replay starts a new generation of the CUDA graph tree, so each graph is a root of its own:
        the graph of one K after another K's (adaptive K, warm-up's order) replays what was recorded instead of
        recording a new path. Callers keep no output of a replay past the next (``reuses_outputs``)."""
        if self.mode is None:
            compiled.__name__ = tag
            return compiled

        def call(*args: Any) -> Any:
            torch.compiler.cudagraph_mark_step_begin()
            return compiled(*args)

        call.__name__ = tag
        return call
