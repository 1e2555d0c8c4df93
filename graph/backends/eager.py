"""The reference: run the graph definitions as plain PyTorch."""
from __future__ import annotations

from .base import DynamicDims, GraphFn, ShapePolicy
from .lint import GraphLint


class EagerBackend:
    name = "eager"
    reuses_outputs = False
    shapes = ShapePolicy(dynamic_batch=True, exact_batch=True, trim_context=True)
    attention_kernel = "gather"
    compile_regions = False

    def __init__(self, graph_failure: str = "eager") -> None:
        self.graph_failure = graph_failure
        #: nothing compiles here: the host-sync counter sees every op of the eager definitions instead
        self.lint = GraphLint(strict=graph_failure == "raise")

    def compile(self, fn: GraphFn, tag: str, dims: DynamicDims | None = None) -> GraphFn:
        return fn
