"""Small building blocks: Linear, RMSNorm, DeepSeek rotary embedding (plain or YaRN), gated MLP."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .config import ModelConfig, YarnScaling


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and names) that can take its product weight-left: ``(W · xᵀ)ᵀ``.

    Decode and verify multiply a handful of tokens by every weight, and on x86 CPUs MKL's sgemm picks a far better
    kernel when the skinny operand is on the right, so a verify's products cost about a one-token step's. Where a
    compiled graph fixes the row count at one or two, the product is a row reduction (``row_reductions``); eager,
    a lone token runs as two (one column is MKL's slowest case). Same function; only the summation order may differ
    (~1e-6). Backends opt in (``weight_left_matmul``); GPUs and NPUs keep the plain product. Figures:
    docs/performance.md, "What a verify costs on CPU".
    """

    #: set by ``DeepseekV3ForCausalLM.use_backend``
    weight_left = False

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:  # a shapes-only build is filled by the loader; see ``Embedding``
            super().reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.weight_left or self.bias is not None:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(-1, x.shape[-1])
        n = flat.shape[0]
        # statically_known_true: a dynamic row count reads False without a guard (a plain comparison would
        # specialise the graph on it)
        if torch.compiler.is_compiling() and statically_known_true(n <= ROW_REDUCTION_MAX_ROWS):
            return row_reductions(flat, self.weight).reshape(*x.shape[:-1], self.out_features)
        if n == 1:
            # One column is MKL's slowest case: a zero token makes it two. Static: a dynamic row count is at least 2.
            flat = F.pad(flat, (0, 0, 0, 1))
        return torch.mm(self.weight, flat.t())[:, :n].t().reshape(*x.shape[:-1], self.out_features)


#: a compiled product of at most this many rows, when the graph's shapes fix the count (a lone request's one-row
#: graphs), is one row reduction per row instead of an MKL call (see ``row_reductions``)
ROW_REDUCTION_MAX_ROWS = 2


def row_reductions(flat: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``flat [n, in] · weightᵀ`` as ``n`` row-wise reductions, which inductor compiles to vectorised loops that
    stream the weight at about the memory's speed; MKL's sgemm streams it several times slower for one row. Each row
    reads the weight again: two rows cost about MKL's two-row product, and from three rows MKL's is cheaper, hence
    ``ROW_REDUCTION_MAX_ROWS``. A row's sum is the same, bit for bit, whatever ``n`` is, so a verify and a
    one-token step give a token the same logits. Eager, this would materialise ``weight``-sized temporaries:
    compiled graphs only."""
    return torch.stack([(weight * flat[i]).sum(-1) for i in range(flat.shape[0])])


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


class Embedding(nn.Embedding):
    """``nn.Embedding`` whose shapes-only (meta) build skips the random init: any op on a meta tensor imports
    torch's Python meta kernels, seconds of a start-up that then loads every weight anyway."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class RotaryEmbedding(nn.Module):
    """DeepSeek's rotary embedding with the layout vLLM uses for DeepSeek (``is_neox_style=False``).

    Pairs of adjacent channels ``(x[2i], x[2i+1])`` rotate by ``pos * theta**(-2i/d)`` ("GPT-J" style).
    HF's ``rope_interleave=True`` path de-interleaves first and rotates halves, which gives the same
    dot products; vLLM keeps the interleaved layout, and so does the cached ``k_pe`` here.
    """

    def __init__(self, dim: int, max_positions: int, theta: float, scaling: YarnScaling | None = None) -> None:
        super().__init__()
        if torch.get_default_device().type == "meta":
            # a shapes-only build (weights.load_model fills a real table in); see ``Embedding``
            self.register_buffer("cos_cached", torch.empty(max_positions, dim // 2), persistent=False)
            self.register_buffer("sin_cached", torch.empty(max_positions, dim // 2), persistent=False)
            return
        pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        inv_freq = 1.0 / pos_freqs
        scale = 1.0
        if scaling is not None:
            inv_freq = yarn_inv_freq(pos_freqs, dim, theta, scaling)
            scale = scaling.cos_sin_scale
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, dim/2]
        self.register_buffer("cos_cached", freqs.cos() * scale, persistent=False)
        self.register_buffer("sin_cached", freqs.sin() * scale, persistent=False)

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> "RotaryEmbedding":
        return cls(cfg.qk_rope_head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [..., heads, dim]; positions: x.shape[:-2] (int). Returns a new tensor."""
        cos = self.cos_cached[positions].unsqueeze(-2)  # [..., 1, dim/2]
        sin = self.sin_cached[positions].unsqueeze(-2)
        xf = x.float()
        x1 = xf[..., 0::2]
        x2 = xf[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        return out.to(x.dtype)

    def rotate_halves(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The same rotation over the other channel pairing, ``(x[i], x[i + dim/2])`` ("NeoX" style: HF's
        ``rotate_half``), as DeepSeek-V3.2's indexer ropes its keys and queries. Same table, same shapes."""
        cos = self.cos_cached[positions].unsqueeze(-2)
        sin = self.sin_cached[positions].unsqueeze(-2)
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def yarn_inv_freq(pos_freqs: torch.Tensor, dim: int, theta: float, s: YarnScaling) -> torch.Tensor:
    """YaRN (vLLM's ``DeepseekScalingRotaryEmbedding``): blend interpolated (÷ factor) and original frequencies
    with a linear ramp between the dims that rotate ``beta_fast`` and ``beta_slow`` times over the original
    context; high-frequency dims keep extrapolating, low-frequency dims are interpolated."""

    def correction_dim(rotations: float) -> float:
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(s.beta_fast)), 0)
    high = min(math.ceil(correction_dim(s.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    return 1.0 / (s.factor * pos_freqs) * (1 - extrapolate) + 1.0 / pos_freqs * extrapolate


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
