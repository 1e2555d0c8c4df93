"""The reference: run the graph definitions as plain PyTorch."""
from __future__ import annotations

from .base import DynamicDims, GraphFn, ShapePolicy


class EagerBackend:
    name = "eager"
    reuses_outputs = False
    shapes = ShapePolicy(dynamic_batch=True, exact_batch=True, trim_context=True)
    attention_kernel = "gather"
    compile_regions = False

    def compile(self, fn: GraphFn, tag: str, dims: DynamicDims | None = None) -> GraphFn:
        return fn
