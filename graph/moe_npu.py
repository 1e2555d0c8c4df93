"""The routed half of DeepSeekMoE on Ascend NPUs, through torch_npu's fused MoE ops.
Same function as :func:`~ascend_spec.graph.moe.grouped_topk` + :func:`~ascend_spec.graph.moe.routed_experts`.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch


class NpuCall(NamedTuple):
    """How we call one torch_npu op: schema names of the arguments passed by position, then by keyword."""

    positional: tuple[str, ...]
    keyword: tuple[str, ...]


#: Every torch_npu op ``routed_experts_npu`` calls, in call order. ``_call`` refuses a call that differs, and the
#: contract test checks each entry against the wheel's schemas, so the two cannot drift apart silently.
NPU_MOE_CALLS: dict[str, NpuCall] = {
    "npu_moe_gating_top_k": NpuCall(("x",), ("k", "bias", "k_group", "group_count", "group_select_mode", "renorm",
                                             "norm_type", "out_flag", "routed_scaling_factor", "eps")),
    "npu_moe_init_routing": NpuCall(("x",), ("row_idx", "expert_idx", "active_num")),
    "npu_moe_compute_expert_tokens": NpuCall(("sorted_expert_for_source_row", "num_expert"), ()),
    "npu_grouped_matmul": NpuCall((), ("x", "weight", "split_item", "group_list_type", "group_type", "group_list")),
    "npu_swiglu": NpuCall(("self",), ("dim",)),
    "npu_moe_finalize_routing": NpuCall(("expanded_permuted_rows",), ("skip1", "skip2", "bias", "scales",
                                                                      "expanded_src_to_dst_row",
                                                                      "export_for_source_row")),
}

#: The epsilon of HF DeepseekV3's renormalisation; also npu_moe_gating_top_k's default.
_RENORM_EPS = 1e-20


def _call(npu: Any, op: str, *args: Any, **kwargs: Any) -> Any:
    spec = NPU_MOE_CALLS[op]
    if len(args) != len(spec.positional) or tuple(kwargs) != spec.keyword:
        raise TypeError(f"{op} called with {len(args)} positional and {tuple(kwargs)} keyword arguments; "
                        f"NPU_MOE_CALLS says {spec}")
    return getattr(npu, op)(*args, **kwargs)


def _check_gating_limits(num_experts: int, top_k: int, n_group: int, topk_group: int) -> None:
    """npu_moe_gating_top_k's documented limits, checked on static ints so a bad config fails before capture."""
    per_group = num_experts // n_group if n_group > 0 else 0
    if not (n_group > 0 and num_experts % n_group == 0 and per_group > 2 and num_experts <= 2048
            and 1 <= topk_group <= n_group and 1 <= top_k <= per_group * topk_group):
        raise ValueError(f"npu_moe_gating_top_k cannot route E={num_experts}, n_group={n_group}, "
                         f"topk_group={topk_group}, top_k={top_k}: it needs E divisible by n_group with more than "
                         f"2 experts per group, E <= 2048, 1 <= topk_group <= n_group, "
                         f"1 <= top_k <= E / n_group * topk_group")


def routed_experts_npu(x: torch.Tensor, router_logits: torch.Tensor, e_score_correction_bias: torch.Tensor,
                       w13: torch.Tensor, w2: torch.Tensor, *, top_k: int, n_group: int, topk_group: int,
                       routed_scaling_factor: float, norm_topk_prob: bool) -> torch.Tensor:
    """x [T, D], fp32 router logits [T, E] → Σ_k w_k · expert_k(x) [T, D] in x's dtype (shared experts excluded)."""
    import torch_npu  # needs CANN; never at module import

    t, _ = x.shape
    num_experts = w13.shape[0]
    _check_gating_limits(num_experts, top_k, n_group, topk_group)
    x = x.contiguous()

    # Routing in fp32, like the reference: bf16 logits would break near-ties.
    logits = router_logits.float()  # [T, E]
    # norm_type=1: sigmoid; group_select_mode=1: group score = sum of its top-2 biased scores; renorm=0 is the
    # only supported value ("norm, then top-k"). With sigmoid the op always renormalises its weights
    # (y / (Σy + eps) · scale; vllm-ascend refuses "sigmoid without renorm" for this op), so without
    # norm_topk_prob only its expert ids are used and the weights are gathered below.
    weights, ids, _ = _call(torch_npu, "npu_moe_gating_top_k", logits,
                            k=top_k, bias=e_score_correction_bias.float(), k_group=topk_group, group_count=n_group,
                            group_select_mode=1, renorm=0, norm_type=1, out_flag=False,
                            routed_scaling_factor=routed_scaling_factor if norm_topk_prob else 1.0, eps=_RENORM_EPS)
    if not norm_topk_prob:
        weights = logits.sigmoid().gather(1, ids.long()) * routed_scaling_factor
    weights = weights.to(x.dtype)  # npu_moe_finalize_routing wants scales in the rows' dtype
    ids = ids.to(torch.int32)

    # row_idx[t, j] = j·T + t: the source-row numbering that npu_moe_init_routing scatters by and that
    # npu_moe_finalize_routing reads back (expanded_src_to_dst_row[t + j·T]). active_num = T keeps all T·k rows.
    row_idx = torch.arange(t * top_k, dtype=torch.int32, device=x.device).view(top_k, t).t().contiguous()
    sorted_x, expanded_row_idx, expanded_expert_idx = _call(torch_npu, "npu_moe_init_routing", x,
                                                            row_idx=row_idx, expert_idx=ids, active_num=t)
    # Cumulative row counts per expert (group_list_type=0); int64 is what npu_grouped_matmul takes.
    expert_tokens = _call(torch_npu, "npu_moe_compute_expert_tokens", expanded_expert_idx, num_experts).to(torch.int64)

    # npu_grouped_matmul computes x_g @ weight[g] with weight [E, K, N]; ours are stored [E, N, K] (vLLM FusedMoE:
    # w13 [E, 2I, D], w2 [E, D, I]), so we pass transpose(1, 2) views. The op reads such a view as a transposed
    # weight (its docs define the inner-axis limit "when weight is transposed"), so nothing is copied.
    # split_item=2: one x tensor in, one tensor out; group_type=0: groups split the M (row) axis.
    gate_up = _call(torch_npu, "npu_grouped_matmul", x=[sorted_x], weight=[w13.transpose(1, 2)], split_item=2,
                    group_list_type=0, group_type=0, group_list=expert_tokens)[0]  # [T·k, 2I]
    # swiglu(dim=-1) = silu(first half) · second half: w13's gate rows come first, so this is silu(gate) · up.
    act = _call(torch_npu, "npu_swiglu", gate_up, dim=-1)  # [T·k, I]
    down = _call(torch_npu, "npu_grouped_matmul", x=[act], weight=[w2.transpose(1, 2)], split_item=2,
                 group_list_type=0, group_type=0, group_list=expert_tokens)[0]  # [T·k, D]
    # out[t] = Σ_j scales[t, j] · down[expanded_src_to_dst_row[t + j·T]]; skip1/skip2/bias have no defaults.
    return _call(torch_npu, "npu_moe_finalize_routing", down, skip1=None, skip2=None, bias=None, scales=weights,
                 expanded_src_to_dst_row=expanded_row_idx, export_for_source_row=ids)
