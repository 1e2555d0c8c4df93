"""torch.compile: plain inductor on CPU, ``reduce-overhead`` (CUDA graphs) on CUDA."""
from __future__ import annotations

import torch

from .base import GraphFn


class InductorBackend:
    name = "inductor"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.mode = "reduce-overhead" if device.type == "cuda" else None
        # CUDA graph replays overwrite their static outputs.
        self.reuses_outputs = device.type == "cuda"

    def compile(self, fn: GraphFn, tag: str) -> GraphFn:
        return torch.compile(fn, fullgraph=True, dynamic=False, mode=self.mode)
