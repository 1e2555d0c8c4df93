"""A module slot filled from outside ``graph/``: how the graphs run on a host engine's layers.

Inside vLLM the drafter runs on the weights vLLM loaded. Where a weight can be viewed (norm scales, stacked
MoE experts, absorbed MLA matrices) our modules hold the host's tensor itself; where it cannot (a CPU-prepacked
GEMM, a quantised or tensor-parallel layer) the slot holds an :class:`External` that calls the host layer's own
forward. ``graph/`` never imports the host engine: ``compat/`` builds the callables.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn


class External(nn.Module):
    def __init__(self, fn: Callable[..., torch.Tensor], name: str = "") -> None:
        super().__init__()
        self.fn = fn
        self.name = name

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.fn(*args)

    def extra_repr(self) -> str:
        return self.name
