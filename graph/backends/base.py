"""The backend interface and the factory that picks one for the device at hand."""
from __future__ import annotations

import types
from typing import Callable, Protocol

import torch

GraphFn = Callable[..., object]


class BackendUnavailable(RuntimeError):
    """The chosen backend cannot run on this machine (e.g. torchair without torch_npu/CANN)."""


class Backend(Protocol):
    name: str
    #: True when a replay overwrites the previous replay's outputs (CUDA graphs, NPU graphs): callers clone.
    reuses_outputs: bool

    def compile(self, fn: GraphFn, tag: str) -> GraphFn:
        """Return the graph-mode version of ``fn``; ``tag`` names the bucket, e.g. ``draft_bs8``."""
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


def compile_per_bucket(backend: Backend, fn: GraphFn, prefix: str, sizes: list[int]) -> dict[int, GraphFn]:
    return {size: backend.compile(clone_with_name(fn, f"{prefix}_bs{size}"), f"{prefix}_bs{size}") for size in sizes}


def resolve_backend_name(name: str, device: torch.device) -> str:
    """``auto``: NPU → torchair, CUDA → inductor (CUDA graphs), CPU → inductor."""
    if name != "auto":
        return name
    if device.type == "npu":
        return "torchair"
    return "inductor"


def get_backend(name: str, device: torch.device | str, *, mode: str = "max-autotune", frozen_parameter: bool = True,
                view_optimize: bool = True, tiling_schedule_optimize: bool = False,
                use_cached_graph: bool = False, distributed: bool = False) -> Backend:
    device = torch.device(device)
    resolved = resolve_backend_name(name, device)
    if resolved == "eager":
        from .eager import EagerBackend

        return EagerBackend()
    if resolved == "inductor":
        from .inductor import InductorBackend

        return InductorBackend(device)
    if resolved == "torchair":
        from .torchair import TorchairBackend, TorchairOptions

        return TorchairBackend(TorchairOptions(mode=mode, frozen_parameter=frozen_parameter,
                                               view_optimize=view_optimize,
                                               tiling_schedule_optimize=tiling_schedule_optimize,
                                               use_cached_graph=use_cached_graph, distributed=distributed))
    raise ValueError(f"backend={name!r}; allowed: ['auto', 'eager', 'inductor', 'torchair']")
