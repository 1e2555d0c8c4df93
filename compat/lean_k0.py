"""A step of vLLM's V1 runner that verifies no draft and drafts none (K = 0) runs as a plain decode step: its token
sampled as without speculation, its draft hand-over cut to holding the MTP layer's cache entries.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterator

import torch

from .manifest import covers
from .shims import device_tensor, host_any

#: ``hold(next_token_ids [B], positions [B], hidden [B, D], slot_mapping [B], plain)``: the drafter holds the
#: step's draft cache entries and returns its ``[B, 0]`` drafts, or None where it cannot; ``plain``: the step ran
#: through the runner's non-speculative branches
Hold = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool], "torch.Tensor | None"]
#: ``takes(batch)``: whether ``hold`` takes a step of ``batch`` rows
Takes = Callable[[int], bool]

_OWN_LEAN = ("_sample", "propose_draft_token_ids", "_copy_valid_sampled_token_count", "_get_positions")
_OWN_PLAIN = ("execute_model", "sample_tokens")


@covers("v1_lean_k0_step")
def install_lean_k0_step(runner: Any, hold: Hold, takes: Takes, draft_layer: str) -> str:
    """Put the lean K = 0 step on ``runner`` (this instance only). Returns how far it goes: ``"plain"`` (a pure
    decode step at K = 0 runs through the runner's non-speculative branches whole), ``"lean"`` (its sampling and
    draft hand-over only), or ``""`` where the release or model allows neither: the runner's own methods must be
    vLLM's V1 ones, with a per-step K (``num_spec_tokens_to_schedule``) and the draft's input the target's last
    hidden states (no auxiliary layers, no model-chosen ones). ``draft_layer``: the draft attention layer whose slots
    the held entries take."""
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    per_step_k = "num_spec_tokens_to_schedule" in getattr(SchedulerOutput, "__dataclass_fields__", {})
    # a model that picks the draft's hidden states itself (DeepSeek-V4's hook, by name on the live model)
    own_hidden = hasattr(runner.get_model(), "get_mtp_target_hidden_states")  # manifest: ignore (a model's hook)
    # the parameters read by name, as the runner's caller passes them (positionally)
    signature = inspect.signature(GPUModelRunner.propose_draft_token_ids)
    named = {"scheduler_output", "sampled_token_ids", "hidden_states", "spec_decode_metadata", "common_attn_metadata"}
    if not _own(runner, GPUModelRunner, _OWN_LEAN) or not per_step_k or not named <= set(signature.parameters) \
            or not hasattr(runner, "discard_request_mask") or getattr(runner, "uses_mrope", False) \
            or getattr(runner, "use_aux_hidden_state_outputs", False) or own_hidden:
        return ""
    at = {name: i for i, name in enumerate(list(signature.parameters)[1:]) if name in named}  # after self
    plain = _PlainStep(runner, hold, takes, draft_layer)
    _install_lean(runner, hold, at, plain)
    if _plain_allowed(runner, GPUModelRunner):
        plain.install()
        return "plain"
    return "lean"


def _own(runner: Any, base: type, names: tuple[str, ...]) -> bool:
    return all(getattr(type(runner), name, None) is getattr(base, name, None) for name in names)


def _plain_allowed(runner: Any, base: type) -> bool:
    """The whole step through the non-speculative branches: vLLM's own ``execute_model``/``sample_tokens`` keeping
    the step's hidden states and per-layer slots between them, and a model with no state the speculative path keeps
    (hybrid). Async scheduling too: a step with no draft verified and none drafted hands its next step what a
    non-speculative one does (the sampled tokens as the next inputs, exact computed-token counts)."""
    from vllm.v1.worker.gpu_model_runner import ExecuteModelState

    fields = {"hidden_states", "slot_mappings"} <= set(getattr(ExecuteModelState, "_fields", ()))  # manifest: ignore
    return _own(runner, base, _OWN_PLAIN) and fields and not runner.model_config.is_hybrid


def _install_lean(runner: Any, hold: Hold, at: dict[str, int], plain: "_PlainStep") -> None:
    sample, propose = runner._sample, runner.propose_draft_token_ids
    ones = torch.ones(runner.max_num_reqs, dtype=torch.int32, device=runner.device)

    def _sample(logits: torch.Tensor | None, spec_decode_metadata: Any) -> Any:
        # No draft to verify: the sampler a non-speculative engine runs (the rejection sampler's bonus token is
        # the same draw, at the cost of its metadata and kernels)
        if spec_decode_metadata is not None and not any(spec_decode_metadata.num_draft_tokens):
            spec_decode_metadata = None
        out = sample(logits, spec_decode_metadata)
        if plain.sampling:
            plain.sampled = out.sampled_token_ids
        return out

    def propose_draft_token_ids(*args: Any, **kwargs: Any) -> Any:
        def arg(name: str) -> Any:  # where the caller put it (a signature bind costs more than the step saves)
            return args[at[name]] if at[name] < len(args) else kwargs[name]

        scheduler_output, spec_decode_metadata = arg("scheduler_output"), arg("spec_decode_metadata")
        b = runner.input_batch.num_reqs
        # Host facts only: no draft verified (up to 0.31 the runner passes no metadata then), none to schedule, one
        # token a row and none discarded (a prompt's partial chunk), so each row's one sampled token is its next
        if ((spec_decode_metadata is not None and any(spec_decode_metadata.num_draft_tokens))
                or scheduler_output.num_spec_tokens_to_schedule or scheduler_output.total_num_scheduled_tokens != b
                or host_any(runner.discard_request_mask, b)):
            return propose(*args, **kwargs)
        next_token_ids = arg("sampled_token_ids")[:b, 0]
        drafts = hold(next_token_ids, runner._get_positions(b), arg("hidden_states")[:b],
                      arg("common_attn_metadata").slot_mapping[:b], False)
        if drafts is None:
            return propose(*args, **kwargs)
        # what the runner's own path hands on: every row's one token valid (async scheduling's next inputs)
        runner._copy_valid_sampled_token_count(next_token_ids, ones[:b])
        return drafts

    runner._sample = _sample
    runner.propose_draft_token_ids = propose_draft_token_ids


@contextlib.contextmanager
def _speculation_hidden(runner: Any) -> Iterator[None]:
    """The runner's branches read ``speculative_config`` to take the speculative path: None for the span."""
    spec, runner.speculative_config = runner.speculative_config, None
    try:
        yield
    finally:
        runner.speculative_config = spec


class _PlainStep:
    """A pure decode step at K = 0 (no new request, one token a row, no draft verified, none to draft) through the
    runner's non-speculative branches: no draft metadata, no rejection sampler, no drafter's attention metadata, no
    draft hand-over; after it the drafter holds the step's MTP cache entries (sampled token, position, target
    hidden state, the draft layer's slot), as the speculative path's K = 0 draft would have written them."""

    def __init__(self, runner: Any, hold: Hold, takes: Takes, draft_layer: str) -> None:
        self.runner, self.hold, self.takes, self.draft_layer = runner, hold, takes, draft_layer
        self.state: Any = None  # the execute_model state of a plain step not sampled yet
        self.sampling = False
        self.sampled: torch.Tensor | None = None

    def install(self) -> None:
        runner = self.runner
        execute, sample_tokens = runner.execute_model, runner.sample_tokens

        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            if not self._is_plain(scheduler_output):
                self.state = None
                return execute(scheduler_output, *args, **kwargs)
            with _speculation_hidden(runner):
                out = execute(scheduler_output, *args, **kwargs)
            self.state = runner.execute_model_state
            return out

        def sample_tokens_(*args: Any, **kwargs: Any) -> Any:
            state, self.state = self.state, None
            if state is None or runner.execute_model_state is not state:
                return sample_tokens(*args, **kwargs)
            self.sampling = True
            try:
                with _speculation_hidden(runner):
                    out = sample_tokens(*args, **kwargs)
            finally:
                self.sampling = False
            sampled, self.sampled = self.sampled, None
            self._hold(state, sampled)
            return out

        runner.execute_model = execute_model
        runner.sample_tokens = sample_tokens_

    def _is_plain(self, so: Any) -> bool:
        b = len(so.num_scheduled_tokens)
        # one token a row means no draft verified; a new request's prompt goes through the drafter's prefill
        return (b > 0 and not so.num_spec_tokens_to_schedule and so.total_num_scheduled_tokens == b
                and not so.scheduled_new_reqs and not so.scheduled_spec_decode_tokens and self.takes(b))

    def _hold(self, state: Any, sampled: torch.Tensor | None) -> None:
        runner = self.runner
        b = runner.input_batch.num_reqs
        slots = state.slot_mappings.get(self.draft_layer) if isinstance(state.slot_mappings, dict) else None
        if sampled is None:
            raise RuntimeError("ascend_spec: a plain K = 0 step's sampler output was not seen; the MTP cache entries "
                               "of the step cannot be held")
        if slots is None:
            raise RuntimeError(f"ascend_spec: a plain K = 0 step kept no slot mapping of the draft layer "
                               f"{self.draft_layer!r}; the MTP cache entries of the step cannot be held")
        next_token_ids = sampled[:b, 0]
        if host_any(runner.discard_request_mask, b):
            # a prompt's partial chunk: its next token is the prompt's, as the speculative path hands it on
            next_token_ids, _ = runner.drafter.prepare_next_token_ids_padded(
                sampled, runner.requests, runner.input_batch, device_tensor(runner.discard_request_mask))
        held = self.hold(next_token_ids, runner._get_positions(b), state.hidden_states[:b], slots[:b], True)
        if held is None:
            raise RuntimeError(f"ascend_spec: a plain K = 0 step of {b} rows was not held, though the drafter "
                               "said it takes it")
