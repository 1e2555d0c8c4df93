"""Small building blocks: RMSNorm, DeepSeek rotary embedding, gated MLP."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, as vLLM and HF do, then cast back.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """DeepSeek's rotary embedding with the layout vLLM uses for DeepSeek (``is_neox_style=False``).

    Pairs of adjacent channels ``(x[2i], x[2i+1])`` rotate by ``pos * theta**(-2i/d)`` ("GPT-J" style).
    HF's ``rope_interleave=True`` path de-interleaves first and rotates halves, which gives the same
    dot products; vLLM keeps the interleaved layout, and so does the cached ``k_pe`` here.
    """

    def __init__(self, dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, dim/2]
        self.register_buffer("cos_cached", freqs.cos(), persistent=False)
        self.register_buffer("sin_cached", freqs.sin(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [..., heads, dim]; positions: x.shape[:-2] (int). Returns a new tensor."""
        cos = self.cos_cached[positions].unsqueeze(-2)  # [..., 1, dim/2]
        sin = self.sin_cached[positions].unsqueeze(-2)
        xf = x.float()
        x1 = xf[..., 0::2]
        x2 = xf[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        return out.to(x.dtype)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
