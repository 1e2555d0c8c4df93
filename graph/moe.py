"""DeepSeekMoE with noaux_tc routing, over vLLM FusedMoE's stacked expert layout.
The routed computation has two fixed-shape formulations, ``gather`` and ``dense``, picked from the shapes.
"""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from .config import MoEConfig
from .layers import MLP

Strategy = Literal["auto", "gather", "dense"]


def grouped_topk(router_logits: torch.Tensor, bias: torch.Tensor,
                 cfg: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """router logits [T, E] → (expert ids [T, k] int64, routing weights [T, k] fp32)."""
    scores = router_logits.float().sigmoid()  # [T, E]
    biased = scores + bias.float()
    t, e = scores.shape
    if cfg.n_group > 1:
        g = cfg.n_group
        group_scores = biased.view(t, g, e // g).topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        keep = group_scores.topk(cfg.topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores).scatter(1, keep, 1.0).bool()
        expert_mask = group_mask.unsqueeze(-1).expand(t, g, e // g).reshape(t, e)
        biased = biased.masked_fill(~expert_mask, float("-inf"))
    ids = biased.topk(cfg.num_experts_per_tok, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * cfg.routed_scaling_factor


def pick_strategy(num_tokens: int, top_k: int, num_experts: int, strategy: Strategy = "auto",
                  compiled: bool | None = None) -> str:
    """Static choice from the shapes (and whether we are being compiled), never from the data."""
    if strategy != "auto":
        return strategy
    compiled = torch.compiler.is_compiling() if compiled is None else compiled
    pairs = num_tokens * top_k
    return "gather" if (pairs <= 8 * num_experts if compiled else 4 * pairs <= num_experts) else "dense"


def routed_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   strategy: Strategy = "auto") -> torch.Tensor:
    """Σ_k weights[t, k] · expert_{ids[t, k]}(x[t]) for x [T, D]; returns [T, D] in x's dtype."""
    t, d = x.shape
    k = ids.shape[1]
    e, two_i, _ = w13.shape
    if pick_strategy(t, k, e, strategy) == "gather":
        flat = ids.reshape(-1)
        xs = x.unsqueeze(1).expand(t, k, d).reshape(t * k, d, 1)
        gate, up = torch.bmm(w13[flat], xs).squeeze(-1).split(two_i // 2, dim=-1)  # [T·k, I] each
        act = (F.silu(gate) * up).unsqueeze(-1)
        out = torch.bmm(w2[flat], act).view(t, k, d)  # [T, k, D]
        return (out.float() * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype)
    gate, up = torch.einsum("td,efd->etf", x, w13).split(two_i // 2, dim=-1)  # [E, T, I] each
    out = torch.einsum("eti,edi->etd", F.silu(gate) * up, w2)  # [E, T, D]
    routing = torch.zeros(t, e, dtype=torch.float32, device=x.device).scatter(1, ids, weights)
    return torch.einsum("etd,te->td", out.float(), routing).to(x.dtype)


class MoEGate(nn.Module):
    """HF names ``mlp.gate.weight [E, D]`` and ``mlp.gate.e_score_correction_bias [E]`` (kept in fp32)."""

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] → [T, E] in fp32 (HF and vLLM route in fp32)."""
        return F.linear(x.float(), self.weight.float())

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        # A model-wide .to(bfloat16) must not round the bias: it breaks near-ties between experts, and HF
        # (``_keep_in_fp32_modules_strict``) and vLLM keep it in fp32 too. Device moves still apply.
        before = self.e_score_correction_bias.data
        super()._apply(fn, recurse)
        after = self.e_score_correction_bias.data
        if before.dtype == torch.float32 and after.dtype != torch.float32:
            self.e_score_correction_bias.data = before.to(after.device)
        return self


class StackedExperts(nn.Module):
    """Routed experts in vLLM FusedMoE's layout; the checkpoint's per-expert tensors are stacked at load."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int) -> None:
        super().__init__()
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden, intermediate))


class MoE(nn.Module):
    def __init__(self, hidden: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = MoEGate(hidden, cfg.n_routed_experts)
        self.experts = StackedExperts(hidden, cfg.moe_intermediate_size, cfg.n_routed_experts)
        self.shared_experts = MLP(hidden, cfg.shared_intermediate_size) if cfg.n_shared_experts else None
        #: "auto" picks per shape (see the module docstring); tests and benchmarks pin one.
        self.strategy: Strategy = "auto"
        #: torch_npu's fused MoE ops (set with the NPU attention kernel, ``use_backend``; on an NPU device always)
        self.npu_ops = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        w13, w2 = self.experts.w13_weight, self.experts.w2_weight
        logits, bias = self.gate.router_logits(flat), self.gate.e_score_correction_bias
        if self.npu_ops or flat.device.type == "npu":  # torch_npu's fused MoE ops (what torchair lowers well)
            from .moe_npu import routed_experts_npu

            c = self.cfg
            out = routed_experts_npu(flat, logits, bias, w13, w2, top_k=c.num_experts_per_tok, n_group=c.n_group,
                                     topk_group=c.topk_group, routed_scaling_factor=c.routed_scaling_factor,
                                     norm_topk_prob=c.norm_topk_prob)
        else:
            ids, weights = grouped_topk(logits, bias, self.cfg)
            out = routed_experts(flat, ids, weights, w13, w2, self.strategy)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view_as(x)
