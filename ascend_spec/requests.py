"""The engine's lowest layer of request types: a request (:class:`Sequence`), a turn's plan and output, and how
far a step reaches into a request's cache and how many drafts fit below ``max_model_len``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .sampling import SamplingParams


@dataclass
class Sequence:
    req_id: int
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    output_ids: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    draft_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]


@dataclass(frozen=True)
class StepPlan:
    """One turn of the engine's loop: prefill ``admitted`` (they run from the next turn), or a decode step of
    ``running`` at K = ``k`` for batch ``bucket`` (``fused``: the one-graph step); neither when nothing can run.
    ``preempted``: the requests making room for this step sent back to the queue."""

    admitted: list[Sequence] = field(default_factory=list)
    running: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    k: int = 0
    bucket: int = 0
    fused: bool = False


@dataclass
class StepOutput:
    """What a turn gave its requests, in order: a decode step's tokens for the running ones, or a prefill's first
    token (and the drafts for the first step) for the admitted ones."""

    tokens: list[list[int]]  # accepted tokens of each row (1 .. 1+K; a prefill's: 1)
    num_draft: list[int]  # drafts verified in each row
    k: int
    #: per row, one {token_id: logprob} per token in ``tokens`` (rows that asked for logprobs), else None
    logprobs: list[list[dict[int, float]] | None] | None = None
    #: a prefill's and the step-by-step path's: each row's next drafts (the fused path keeps them on device)
    drafts: list[list[int]] | None = None


def step_tokens(num_tokens: int, k: int) -> int:
    """Cache positions a step at K = ``k`` touches, from 0, for a request of ``num_tokens``: the verify writes up to
    ``start + K``, the chained drafts up to ``start + 2K - 1`` (``start = num_tokens - 1``, the last token's)."""
    return num_tokens - 1 + max(1 + k, 2 * k)


def drafts_fit(num_tokens: int, offered: int, max_model_len: int) -> int:
    """Drafts of the ``offered`` a step verifies for a request of ``num_tokens``: room for them and the bonus token
    below ``max_model_len`` (the fused step's verify computes the same on device)."""
    return max(0, min(offered, max_model_len - (num_tokens - 1) - 2))
