"""A step of vLLM's V1 runner that verifies no draft and drafts none (K = 0) runs as a plain decode step: its token
sampled as without speculation, its draft hand-over cut to holding the MTP layer's cache entries.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from .manifest import covers
from .shims import host_tensor

#: ``hold(next_token_ids [B], positions [B], hidden [B, D], common_attn_metadata)``: the drafter holds the step's
#: draft cache entries and returns its ``[B, 0]`` drafts, or None where it cannot (the runner's own path runs then)
Hold = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any], "torch.Tensor | None"]


@covers("v1_lean_k0_step")
def install_lean_k0_step(runner: Any, hold: Hold) -> bool:
    """Put the lean K = 0 step on ``runner`` (this instance only); False where its release or model does not
    allow it: the runner's own methods must be vLLM's V1 ones, with a per-step K (``num_spec_tokens_to_schedule``)
    and the draft's input the target's last hidden states (no auxiliary layers, no model-chosen ones)."""
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    own = all(getattr(type(runner), name, None) is getattr(GPUModelRunner, name, None)
              for name in ("_sample", "propose_draft_token_ids", "_copy_valid_sampled_token_count", "_get_positions"))
    per_step_k = "num_spec_tokens_to_schedule" in getattr(SchedulerOutput, "__dataclass_fields__", {})
    # a model that picks the draft's hidden states itself (DeepSeek-V4's hook, by name on the live model)
    own_hidden = hasattr(runner.get_model(), "get_mtp_target_hidden_states")  # manifest: ignore (a model's hook)
    # the parameters read by name, as the runner's caller passes them (positionally)
    signature = inspect.signature(GPUModelRunner.propose_draft_token_ids)
    named = {"scheduler_output", "sampled_token_ids", "hidden_states", "spec_decode_metadata", "common_attn_metadata"}
    if not own or not per_step_k or not named <= set(signature.parameters) \
            or not hasattr(runner, "discard_request_mask") \
            or getattr(runner, "use_aux_hidden_state_outputs", False) or own_hidden:
        return False
    sample, propose = runner._sample, runner.propose_draft_token_ids
    at = {name: i for i, name in enumerate(list(signature.parameters)[1:]) if name in named}  # after self
    ones = torch.ones(runner.max_num_reqs, dtype=torch.int32, device=runner.device)

    def _sample(logits: torch.Tensor | None, spec_decode_metadata: Any) -> Any:
        # No draft to verify: the sampler a non-speculative engine runs (the rejection sampler's bonus token is
        # the same draw, at the cost of its metadata and kernels)
        if spec_decode_metadata is not None and not any(spec_decode_metadata.num_draft_tokens):
            spec_decode_metadata = None
        return sample(logits, spec_decode_metadata)

    def propose_draft_token_ids(*args: Any, **kwargs: Any) -> Any:
        def arg(name: str) -> Any:  # where the caller put it (a signature bind costs more than the step saves)
            return args[at[name]] if at[name] < len(args) else kwargs[name]

        scheduler_output, spec_decode_metadata = arg("scheduler_output"), arg("spec_decode_metadata")
        b = runner.input_batch.num_reqs
        # Host facts only: no draft verified (up to 0.31 the runner passes no metadata then), none to schedule, one
        # token a row and none discarded (a prompt's partial chunk), so each row's one sampled token is its next
        if ((spec_decode_metadata is not None and any(spec_decode_metadata.num_draft_tokens))
                or scheduler_output.num_spec_tokens_to_schedule or scheduler_output.total_num_scheduled_tokens != b
                or bool(host_tensor(runner.discard_request_mask)[:b].any())):
            return propose(*args, **kwargs)
        next_token_ids = arg("sampled_token_ids")[:b, 0]
        drafts = hold(next_token_ids, runner._get_positions(b), arg("hidden_states")[:b], arg("common_attn_metadata"))
        if drafts is None:
            return propose(*args, **kwargs)
        # what the runner's own path hands on: every row's one token valid (async scheduling's next inputs)
        runner._copy_valid_sampled_token_count(next_token_ids, ones[:b])
        return drafts

    runner._sample = _sample
    runner.propose_draft_token_ids = propose_draft_token_ids
    return True
