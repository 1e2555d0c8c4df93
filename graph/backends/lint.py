"""Graph lint: find the ops of a captured graph that need the host, before the backend lowers it.
Every backend that compiles passes Dynamo's FX graph through :meth:`GraphLint.check` first.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

logger = logging.getLogger(__name__)

_SCALAR_METHODS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__"}
_DATA_DEPENDENT = {"nonzero", "masked_select", "unique", "unique_consecutive", "_unique2", "unique_dim", "argwhere"}
_HOST_COPY_METHODS = {"cpu", "numpy"}


class GraphHostOpError(RuntimeError):
    """Strict mode: a graph holds ops that need the host."""


@dataclass(frozen=True, slots=True)
class HostOp:
    """One op of a captured graph that needs the host: what it is, the graph, and the user source line."""

    graph: str
    op: str
    kind: str  # "scalar output" | "data-dependent shape" | "device->host copy"
    where: str

    def __str__(self) -> str:
        return f"{self.graph}: {self.kind} {self.op} at {self.where}"


def _op_name(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    return getattr(target, "__name__", None) or str(target)


def _source_line(node: torch.fx.Node) -> str:
    """``file:line: code`` of the user frame that made ``node`` (the last frame of its stack trace)."""
    trace = node.meta.get("stack_trace") or ""
    lines = [line.strip() for line in trace.strip().splitlines()]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith('File "'):
            where = lines[i][len('File "'):].replace('", line ', ":").split(",")[0]
            code = lines[i + 1] if i + 1 < len(lines) else ""
            return f"{where}: {code}" if code else where
    return "<unknown source line>"


def _on_device(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type not in ("cpu", "meta")


def _is_cpu(device: Any) -> bool:
    try:
        return device is not None and torch.device(device).type == "cpu"
    except (TypeError, RuntimeError):
        return False


def _classify(node: torch.fx.Node) -> str | None:
    if node.op not in ("call_method", "call_function"):
        return None
    name = _op_name(node).split(".")[-1]
    if name in _SCALAR_METHODS or name == "_local_scalar_dense":
        return "scalar output"
    if name in _DATA_DEPENDENT:
        return "data-dependent shape"
    if name in _HOST_COPY_METHODS:
        return "device->host copy"
    if name in ("to", "_to_copy", "copy_"):
        source = node.args[0].meta.get("example_value") if node.args and isinstance(node.args[0],
                                                                                     torch.fx.Node) else None
        targets = [node.kwargs.get("device"), *(a for a in node.args[1:] if isinstance(a, (str, torch.device)))]
        if _on_device(source) and any(_is_cpu(t) for t in targets):
            return "device->host copy"
    # A tensor whose shape holds an unbacked symbol was sized from data (scalars derived from an ``item`` are
    # that op's finding, not new ones).
    value = node.meta.get("example_value", node.meta.get("val"))
    values = value if isinstance(value, (list, tuple)) else (value,)
    if any(isinstance(v, torch.Tensor) and free_unbacked_symbols(v.shape) for v in values):
        return "data-dependent shape"
    return None


def _graphs(gm: torch.fx.GraphModule) -> Iterator[torch.fx.GraphModule]:
    """``gm`` and its nested graphs (compile regions, higher-order ops' bodies)."""
    for module in gm.modules():
        if isinstance(module, torch.fx.GraphModule):
            yield module


def find_host_ops(gm: torch.fx.GraphModule, graph: str) -> list[HostOp]:
    found = []
    for module in _graphs(gm):
        for node in module.graph.nodes:
            kind = _classify(node)
            if kind is not None:
                found.append(HostOp(graph, _op_name(node), kind, _source_line(node)))
    return found


@dataclass
class GraphLint:
    """Checks each graph a backend compiles; ``strict`` refuses one with host ops, else they are counted."""

    strict: bool
    findings: list[HostOp] = field(default_factory=list)
    graphs_checked: int = 0

    def check(self, gm: torch.fx.GraphModule, graph: str) -> None:
        self.graphs_checked += 1
        self.report(find_host_ops(gm, graph), graph)

    def report(self, found: list[HostOp], graph: str) -> None:
        """What a check of ``graph`` found (or a stored graph's findings, on load): refused or counted."""
        if not found:
            return
        if self.strict:
            raise GraphHostOpError(f"graph {graph!r} needs the host at run time ({len(found)} op(s)); each would be "
                                   "a device sync on CUDA/NPU:\n  " + "\n  ".join(map(str, found)))
        new = [f for f in found if f not in self.findings]
        self.findings.extend(found)
        for f in new:
            logger.warning("graph lint: %s (a device sync on CUDA/NPU; graph_failure=raise refuses it)", f)

    def wrap(self, compiler: Callable[..., Any], graph: str) -> Callable[..., Any]:
        """A Dynamo backend that checks the graph, then hands it to ``compiler``."""

        def linted(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            self.check(gm, graph)
            return compiler(gm, example_inputs)

        linted.__name__ = f"linted_{getattr(compiler, '__name__', type(compiler).__name__)}"
        return linted
