"""The reference: run the graph definitions as plain PyTorch."""
from __future__ import annotations

from .base import GraphFn


class EagerBackend:
    name = "eager"
    reuses_outputs = False

    def compile(self, fn: GraphFn, tag: str) -> GraphFn:
        return fn
