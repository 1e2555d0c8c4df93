"""Count host syncs (device -> host reads and data-dependent shapes) in a block of code.
:class:`HostSyncCounter`: a ``TorchFunctionMode`` for Python-level reads, a ``TorchDispatchMode`` for aten ops.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext

from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_SYNC_METHODS = {
    "item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__", "__complex__",
}

_aten = torch.ops.aten
# Ops whose output shape depends on tensor values: the host must read the data to allocate.
_DATA_DEPENDENT_OPS = {
    _aten._local_scalar_dense.default,
    _aten.nonzero.default,
    _aten.masked_select.default,
    _aten._unique2.default,
    _aten.unique_dim.default,
    _aten.unique_consecutive.default,
}


def _is_offhost(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta")


def _dispatch_sync_name(func: Any, args: tuple, kwargs: dict) -> str | None:
    """Name of the sync an aten call causes, or None."""
    if func in _DATA_DEPENDENT_OPS:
        return str(func)
    if func is _aten.index.Tensor:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
            return "aten.index.Tensor(bool mask)"
        return None
    if func is _aten.repeat_interleave.Tensor:
        if kwargs.get("output_size") is None and (len(args) < 3 or args[2] is None):
            return "aten.repeat_interleave.Tensor(no output_size)"
        return None
    if func is _aten._to_copy.default:
        target = kwargs.get("device")
        if _is_offhost(args[0]) and target is not None and torch.device(target).type == "cpu":
            return "aten._to_copy(device->cpu)"
        return None
    if func is _aten.copy_.default:
        dst, src = args[0], args[1]
        if _is_offhost(src) and isinstance(dst, torch.Tensor) and dst.device.type == "cpu":
            return "aten.copy_(device->cpu)"
    return None


class _FunctionLayer(TorchFunctionMode):
    def __init__(self, owner: "HostSyncCounter") -> None:
        super().__init__()
        self._owner = owner

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", None)
        if name not in _SYNC_METHODS or not (args and isinstance(args[0], torch.Tensor)):
            return func(*args, **kwargs)
        self._owner._record(f"Tensor.{name}")
        self._owner._suppress += 1  # the aten ops below belong to this event
        try:
            return func(*args, **kwargs)
        finally:
            self._owner._suppress -= 1


class _DispatchLayer(TorchDispatchMode):
    def __init__(self, owner: "HostSyncCounter") -> None:
        super().__init__()
        self._owner = owner

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not self._owner._suppress:
            name = _dispatch_sync_name(func, args, kwargs)
            if name is not None:
                self._owner._record(name)
        return func(*args, **kwargs)


_ACTIVE: list["HostSyncCounter"] = []


@contextmanager
def suspended() -> Iterator[None]:
    """Run a compiled graph replay outside the innermost active counter.

    Dynamo would retrace a compiled function under a Python dispatch mode. What runs inside the graph is not
    counted here: ``fullgraph=True`` does not keep host reads out (Dynamo captures ``.item()`` and integer
    ``.tolist()`` as scalar outputs), so the graph lint (``graph.backends.lint``) checks each graph when it is
    compiled, and strict mode (``graph_failure: raise``) refuses one that needs the host.
    """
    if not _ACTIVE:
        yield
        return
    counter = _ACTIVE[-1]
    counter._function.__exit__(None, None, None)
    counter._dispatch.__exit__(None, None, None)
    try:
        yield
    finally:
        counter._dispatch.__enter__()
        counter._function.__enter__()


def suspended_if_compiled(backend: Any) -> Any:
    """``suspended()`` for compiled backends; eager graph definitions stay counted op by op."""
    return nullcontext() if getattr(backend, "name", "eager") == "eager" else suspended()


class HostSyncCounter:
    """Context manager counting host syncs; ``strict=True`` raises at the first one (for a usable traceback)."""

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict
        self.events: list[str] = []
        self._suppress = 0
        self._dispatch = _DispatchLayer(self)
        self._function = _FunctionLayer(self)

    @property
    def count(self) -> int:
        return len(self.events)

    def _record(self, name: str) -> None:
        self.events.append(name)
        if self.strict:
            raise RuntimeError(f"host sync inside HostSyncCounter(strict=True): {name}")

    def __enter__(self) -> "HostSyncCounter":
        self._dispatch.__enter__()
        try:
            self._function.__enter__()
        except BaseException:
            self._dispatch.__exit__(None, None, None)
            raise
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.remove(self)
        try:
            self._function.__exit__(*exc)
        finally:
            self._dispatch.__exit__(*exc)


@contextmanager
def counted_into(stats: Any, enabled: bool, transfers: bool = False) -> Iterator[None]:
    """Count the host syncs of the block into ``stats`` (a ``RunStats``) when ``enabled`` (``count_host_syncs``):
    as ``host_syncs`` (a step's graphs: there must be none), or with ``transfers`` as ``host_transfers`` (the
    step's results read afterwards: there must be one)."""
    if not enabled:
        yield
        return
    with HostSyncCounter() as counter:
        yield
    if transfers:
        stats.host_transfers += counter.count
        stats.host_transfer_events.extend(counter.events)
    else:
        stats.host_syncs += counter.count
        stats.host_sync_events.extend(counter.events)
