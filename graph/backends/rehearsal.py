"""torchair's shape policy without an NPU: a rehearsal of the graphs a GE deployment compiles and replays.
One graph per batch bucket and query width, each key held to its first call's shapes (:class:`GraphShapeError`).
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from .base import DynamicDims, GraphFn
from .lint import GraphLint
from .torchair import TorchairBackend


class GraphShapeError(RuntimeError):
    """A compiled key called at shapes other than those it was compiled for."""


def call_shapes(args: tuple[Any, ...]) -> tuple:
    """What a per-shape graph is specialised on: every tensor's shape and every other leaf's value."""
    return tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in tree_leaves(args))


class RehearsalBackend:
    name = "torchair-rehearsal"
    reuses_outputs = True
    shapes = TorchairBackend.shapes
    attention_kernel = "gather"
    compile_regions = False

    def __init__(self, graph_failure: str = "eager") -> None:
        self.graph_failure = graph_failure
        #: nothing is traced here (the definitions run eagerly): the host-sync counter sees their ops instead
        self.lint = GraphLint(strict=graph_failure == "raise")
        #: each key's shapes at its first call (its "compile")
        self.recorded: dict[str, tuple] = {}
        #: calls per key
        self.replays: dict[str, int] = {}

    def compile(self, fn: GraphFn, tag: str, dims: DynamicDims | None = None) -> GraphFn:
        def graph(*args: Any) -> Any:
            shapes = call_shapes(args)
            first = self.recorded.setdefault(tag, shapes)
            if first != shapes:
                raise GraphShapeError(f"graph {tag!r} was compiled for shapes {first} and is called with {shapes}: "
                                      "a per-shape backend (torchair GE graphs) would compile it again")
            self.replays[tag] = self.replays.get(tag, 0) + 1
            return fn(*args)

        graph.__name__ = tag
        return graph
