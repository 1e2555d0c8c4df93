"""The factory that picks a backend for the device at hand and builds it; each backend module is imported only
when chosen (torchair needs torch_npu and CANN), and none of them imports this one.
"""
from __future__ import annotations

import torch

from .base import Backend, resolve_graph_failure


def resolve_backend_name(name: str, device: torch.device) -> str:
    """``auto``: NPU → torchair, CUDA → inductor (CUDA graphs), CPU → inductor."""
    if name != "auto":
        return name
    if device.type == "npu":
        return "torchair"
    return "inductor"


def get_backend(name: str, device: torch.device | str, *, mode: str = "max-autotune", frozen_parameter: bool = True,
                view_optimize: bool = True, tiling_schedule_optimize: bool = False,
                use_cached_graph: bool = False, distributed: bool = False, input_guards_only: bool = False,
                graph_failure: str | None = None, draft_kv_lengths: str = "auto") -> Backend:
    """``input_guards_only``: inductor on CPU re-checks only the guards on a graph's arguments on each call
    (``graph.backends.guards``), for callers whose graphs take every per-call value as an argument.
    ``graph_failure``: see :func:`resolve_graph_failure`. ``draft_kv_lengths``: torchair only, see
    ``torchair.resolve_draft_kv_lengths``."""
    device = torch.device(device)
    resolved = resolve_backend_name(name, device)
    policy = resolve_graph_failure(graph_failure)
    backend: Backend
    if resolved == "eager":
        from .eager import EagerBackend

        backend = EagerBackend(policy)
    elif resolved == "inductor":
        from .inductor import InductorBackend

        backend = InductorBackend(device, input_guards_only=input_guards_only, graph_failure=policy)
    elif resolved == "torchair-rehearsal":
        from .rehearsal import RehearsalBackend

        backend = RehearsalBackend(policy)
    elif resolved == "torchair":
        from .torchair import TorchairBackend, TorchairOptions, resolve_draft_kv_lengths

        backend = TorchairBackend(TorchairOptions(mode=mode, frozen_parameter=frozen_parameter,
                                                  draft_kv_lengths=resolve_draft_kv_lengths(draft_kv_lengths, mode),
                                                  view_optimize=view_optimize,
                                                  tiling_schedule_optimize=tiling_schedule_optimize,
                                                  use_cached_graph=use_cached_graph, distributed=distributed),
                                  graph_failure=policy)
    else:
        raise ValueError(f"backend={name!r}; allowed: ['auto', 'eager', 'inductor', 'torchair', "
                         "'torchair-rehearsal']")
    return backend
