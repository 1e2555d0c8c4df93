"""A module slot filled from outside ``graph/``: how the graphs run on a host engine's layers.
Where a host weight cannot be viewed, the slot holds an :class:`External` that calls the host layer's own forward.
"""
from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch import nn

#: opaque Externals, indexed by the op's ``index`` argument (process-wide). Weak: an engine torn down frees its host
#: layers, and the next engine's take their slots again, so that it calls the same numbers and loads the graphs
#: the last one saved (a process may build several engines in turn, as the test harness does).
_OPAQUE: list[weakref.ref] = []


def _claim_slot(module: nn.Module) -> int:
    """The lowest slot whose External was freed, else a new one."""
    ref = weakref.ref(module)
    for index, held in enumerate(_OPAQUE):
        if held() is None:
            _OPAQUE[index] = ref
            return index
    _OPAQUE.append(ref)
    return len(_OPAQUE) - 1


@torch.library.custom_op("ascend_spec::external", mutates_args=())
def external_op(x: torch.Tensor, index: int) -> torch.Tensor:
    module = _OPAQUE[index]()
    if module is None:
        raise RuntimeError(f"ascend_spec::external: opaque External #{index} was freed; its graph is stale")
    out = module.fn(x)
    # A custom op's output may not alias its input.
    return out.clone() if out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() else out


@external_op.register_fake
def _(x: torch.Tensor, index: int) -> torch.Tensor:
    return torch.empty_like(x)


class External(nn.Module):
    def __init__(self, fn: Callable[..., torch.Tensor], name: str = "", opaque: bool = False) -> None:
        super().__init__()
        self.fn = fn
        self.name = name
        self.index: int | None = None
        if opaque:
            self.index = _claim_slot(self)

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        if self.index is not None:
            (x,) = args
            return external_op(x, self.index)
        return self.fn(*args)

    def extra_repr(self) -> str:
        return f"{self.name} (opaque)" if self.index is not None else self.name


def opaque_indices(model: nn.Module) -> list[int]:
    """The op indices of ``model``'s opaque Externals: a compiled graph calls its externals by these numbers, which
    are this process's (the order engines registered them), so a graph saved whole is valid only where they match."""
    return [m.index for m in model.modules() if isinstance(m, External) and m.index is not None]
