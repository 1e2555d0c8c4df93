"""Test support: make compiled bucket graphs raise on chosen calls, to exercise the eager fallback.

A failing call first runs the real graph (so its cache writes happen, as in a fault mid-run) and then raises.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ascend_spec.fused_step import SpecStepGraphs
from ascend_spec.graph.buckets import BucketedGraph


class InjectedFault(RuntimeError):
    pass


@dataclass
class FaultPlan:
    """Calls (1-based, counted across every bucket of one graph) that raise after running."""

    fail_on: frozenset[int]
    calls: int = 0
    raised: list[int] = field(default_factory=list)

    def wrap(self, graph: Callable) -> Callable:
        def faulty(*args):
            self.calls += 1
            out = graph(*args)
            if self.calls in self.fail_on:
                self.raised.append(self.calls)
                raise InjectedFault(f"injected fault on graph call {self.calls}")
            return out
        return faulty


def inject_graph_faults(graph: BucketedGraph | SpecStepGraphs, fail_on: set[int] | list[int]) -> FaultPlan:
    """Wrap every compiled graph of ``graph`` (a bucketed graph, or the fused step graphs built on demand)."""
    plan = FaultPlan(frozenset(fail_on))
    if isinstance(graph, BucketedGraph):
        graph.graphs = {size: plan.wrap(g) for size, g in graph.graphs.items()}
    else:
        build = graph.get
        graph.get = lambda key: plan.wrap(build(key))  # type: ignore[method-assign]
    return plan
