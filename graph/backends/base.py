"""The backend interface: what a backend promises (:class:`Backend`, its :class:`ShapePolicy`), the graph failure
policy, and compiling one graph per bucket. Picking a backend is :mod:`.factory`'s (it imports every backend)."""
from __future__ import annotations

import os
import types
from dataclasses import dataclass
from typing import Callable, Protocol

from .lint import GraphLint

GraphFn = Callable[..., object]

#: what a compiled graph's failure does: ``eager`` reruns that step on the eager definition (counted, the first
#: traceback of each graph logged), ``raise`` raises it (and the graph lint refuses graphs that need the host)
GRAPH_FAILURE_POLICIES = ("eager", "raise")
#: the policy where no setting names one (CI and the test suite set ``raise``); unset: ``eager``
GRAPH_FAILURE_ENV = "ASCEND_SPEC_GRAPH_FAILURE"


def resolve_graph_failure(setting: str | None) -> str:
    """The graph failure policy: ``setting`` when given, else ``$ASCEND_SPEC_GRAPH_FAILURE``, else ``eager``."""
    where = "graph_failure"
    if setting is None:
        setting = os.environ.get(GRAPH_FAILURE_ENV) or "eager"
        where = GRAPH_FAILURE_ENV
    if setting not in GRAPH_FAILURE_POLICIES:
        raise ValueError(f"{where}={setting!r}; allowed: {list(GRAPH_FAILURE_POLICIES)}")
    return setting


@dataclass(frozen=True, slots=True)
class ShapePolicy:
    """What a backend needs static. Context length is data everywhere; the batch is a graph dimension only
    where the hardware asks (CUDA graphs and GE graphs replay one batch size each).

    - ``dynamic_batch``: one compile serves every batch size (inductor); False: one compile per bucket (torchair).
    - ``exact_batch``: run the live row count, no bucket padding (CPU inductor, eager); False: pad to buckets.
    - ``trim_context``: callers pass block tables trimmed to the live blocks (a dynamic width); False: the full
      width, and the attention kernel skips dead blocks itself (FlexAttention, the NPU fused op).
    - ``min_batch``: rows are padded to at least this (a size-1 dimension specialises a dynamic compile).
    """

    dynamic_batch: bool
    exact_batch: bool
    trim_context: bool
    min_batch: int = 1


@dataclass(frozen=True, slots=True)
class DynamicDims:
    """Which arguments of a graph function carry the batch (dim 0), the block-table width (dim 1) and the query
    width (dim 1: tokens per request, 1 + K at decode, a prompt's length at prefill)."""

    batch: tuple[int, ...]
    width: tuple[int, ...] = ()
    query: tuple[int, ...] = ()
    #: the arguments from this one on hold KV caches (tensors, or tensors in tuples), whose dim 0 counts the
    #: pool's blocks: a host engine sizes it from free memory at each start, so a graph saved whole keeps it
    #: dynamic (None: no cache arguments)
    pools_from: int | None = None


class BackendUnavailable(RuntimeError):
    """The chosen backend cannot run on this machine (e.g. torchair without torch_npu/CANN)."""


class Backend(Protocol):
    name: str
    #: True when a replay overwrites the previous replay's outputs (CUDA graphs, NPU graphs): callers clone.
    reuses_outputs: bool
    shapes: ShapePolicy
    #: the paged attention kernel the graphs use (graph.mla_kernels.KERNELS)
    attention_kernel: str
    #: one of GRAPH_FAILURE_POLICIES
    graph_failure: str
    #: checks every graph this backend compiles for ops that need the host (graph.backends.lint)
    lint: GraphLint

    def compile(self, fn: GraphFn, tag: str, dims: DynamicDims | None = None) -> GraphFn:
        """Return the graph-mode version of ``fn``; ``tag`` names it, e.g. ``draft`` or ``draft_bs8``. ``dims``:
        its batch and width dimensions, compiled dynamic where ``shapes.dynamic_batch`` (ignored otherwise)."""
        ...


def clone_with_name(fn: GraphFn, name: str) -> GraphFn:
    """A copy of ``fn`` with its own code object, so each bucket gets its own Dynamo cache entry.

    Dynamo caches compiled frames per code object; sharing one across bucket sizes would count each size
    as a recompile and hit the recompile limit. vllm-ascend did the same with a per-size ``co_name``.
    """
    code = fn.__code__.replace(co_name=name)
    clone = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    clone.__kwdefaults__ = fn.__kwdefaults__
    return clone


def compile_per_bucket(backend: Backend, fn: GraphFn, prefix: str, sizes: list[int],
                       dims: DynamicDims | None = None, queries: list[int] | None = None
                       ) -> dict[int | tuple[int, int], GraphFn]:
    """One graph per bucket (and per query width of ``queries``: keys ``(size, query)``); on a dynamic-batch
    backend one graph shared by every bucket."""
    if backend.shapes.dynamic_batch:
        graph = backend.compile(clone_with_name(fn, prefix), prefix, dims)
        return {size: graph for size in sizes}
    if queries:
        tags = {(size, q): f"{prefix}_bs{size}_q{q}" for size in sizes for q in queries}
    else:
        tags = {size: f"{prefix}_bs{size}" for size in sizes}
    return {key: backend.compile(clone_with_name(fn, tag), tag) for key, tag in tags.items()}
