"""The K policy: each decode step's K (0..k_max) and nominal bucket, and the running acceptance it weighs.
The scheduler asks it (``plan``) before making cache room; steps report their cost and verified drafts back.
"""
from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

from .adaptive import LEARN_DRAFTS, LEARN_STEPS, AdaptiveK, choose_k
from .requests import Sequence
from .sampling import MAX_LOGPROBS

#: pseudo-drafts each position's acceptance starts from
PRIOR_WEIGHT = 2
#: drafts per position of the exponential window acceptance is averaged over: it follows the requests running now
ACCEPTANCE_WINDOW = 64
#: while learning, a position offered fewer drafts is weighed at the rate of the one before (a step down stops
#: drafting it, so its figure would stay)
LEARN_POSITION_DRAFTS = 32
#: a deferred K is compiled only while the longest running request has this many tokens to go (a compile a run
#: ends soon after costs more than it saves). Values' sources: docs/performance.md, "Tuned constants"
DEFERRED_MIN_TOKENS = 128


@dataclass
class AcceptanceTracker:
    """Per-position conditional acceptance a_j = P(draft j accepted | drafts < j accepted): counts over the run
    (``offered``, ``accepted``), and ``rates()`` over the last ``ACCEPTANCE_WINDOW`` or so drafts of each position,
    smoothed by ``PRIOR_WEIGHT`` pseudo-drafts at the rate of the position before (1/2 for the first): deep
    positions are verified only when a K reaching them runs, and a flat prior would keep a low K from ever
    picking a high one, while MTP heads' conditional acceptance holds or rises with depth."""

    offered: list[int]
    accepted: list[int]
    #: exponentially weighted counts: each draft of a position multiplies that position's by 1 - 1/window first
    recent_offered: list[float]
    recent_accepted: list[float]

    @classmethod
    def empty(cls, k_max: int) -> "AcceptanceTracker":
        return cls([0] * k_max, [0] * k_max, [0.0] * k_max, [0.0] * k_max)

    def record(self, num_draft: int, num_accepted: int) -> None:
        keep = 1 - 1 / ACCEPTANCE_WINDOW
        for j in range(num_draft):
            if j <= num_accepted:
                hit = j < num_accepted
                self.offered[j] += 1
                self.accepted[j] += hit
                self.recent_offered[j] = keep * self.recent_offered[j] + 1
                self.recent_accepted[j] = keep * self.recent_accepted[j] + hit

    def age(self) -> None:
        """A step that verified no drafts (K = 0) ages the window as one draft of each position would, so the
        figures K = 0 was chosen on give way to what explorations verify."""
        keep = 1 - 1 / ACCEPTANCE_WINDOW
        self.recent_offered = [keep * o for o in self.recent_offered]
        self.recent_accepted = [keep * a for a in self.recent_accepted]

    def rates(self, min_drafts: int = 0) -> list[float]:
        """a_1..a_Kmax; a position offered fewer than ``min_drafts`` drafts over the run takes the rate before it."""
        rates, prior = [], 0.5
        for a, o, n in zip(self.recent_accepted, self.recent_offered, self.offered):
            if n >= min_drafts:
                prior = (a + PRIOR_WEIGHT * prior) / (o + PRIOR_WEIGHT)
            rates.append(prior)
        return rates


def in_step_share(running: list[Sequence]) -> float:
    """The share of ``running`` that plain decoding would keep in step: requests whose token budget another one
    shares. Rows of equal budgets finish together without drafts, and drafting sets them apart."""
    budgets = Counter(s.max_tokens for s in running)
    return sum(n for n in budgets.values() if n > 1) / len(running)


class DeferredGraphs(Protocol):
    """What the policy asks of warm-up (:class:`.warmup.GraphWarmup`): the K values whose graphs it deferred, and
    to compile one of them before the step that picked it runs."""

    deferred: set[int]

    def compile_deferred(self, k: int, why: str) -> None: ...


@dataclass(frozen=True)
class StepK:
    """A decode step's K for its batch ``bucket``; ``fused``: the one-graph step applies (else the step-by-step
    path, which drafts K_max)."""

    k: int
    bucket: int
    fused: bool


@dataclass
class KPolicy:
    """K per step: ``force_k`` when set, K_max with ``adaptive`` off, else adaptive K per batch bucket."""

    k_max: int
    adaptive: bool
    #: nominal batch buckets (``GraphModeConfig.batch_sizes``): the units adaptive K is chosen for
    batch_sizes: tuple[int, ...]
    #: the one-graph step is on (``EngineConfig.fused_step``): it applies to batches up to the largest bucket
    fused_step: bool = True
    acceptance: AcceptanceTracker = field(init=False)
    #: step costs per bucket and K (warm-up measures them, fused steps follow them) and each bucket's choice
    costs: AdaptiveK = field(init=False)
    #: run every fused step at this K (0..K_max; its graphs must be warm: adaptive K warms them all)
    force_k: int | None = None
    #: steps adaptive K has drafted at its learning K (``LEARN_STEPS``)
    learning_steps: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.adaptive = bool(self.adaptive and self.k_max)
        self.acceptance = AcceptanceTracker.empty(self.k_max)
        self.costs = AdaptiveK(self.k_max)

    @property
    def step_seconds(self) -> dict[int, dict[int, float]]:
        """Seconds of one fused step per bucket and K (adaptive K)."""
        return self.costs.step_seconds

    def restart(self) -> None:
        """Learn afresh, as an engine started now would: no draft verified, no learning step run, no bucket's K
        chosen; the step costs measured so far stay."""
        self.acceptance = AcceptanceTracker.empty(self.k_max)
        self.learning_steps = 0
        self.costs.restart()

    def nominal_bucket(self, batch: int) -> int | None:
        """The nominal bucket of ``batch`` requests; None above the largest."""
        i = bisect.bisect_left(self.batch_sizes, batch)
        return self.batch_sizes[i] if i < len(self.batch_sizes) else None

    def fused_applies(self, running: list[Sequence]) -> bool:
        return (self.fused_step and len(running) <= self.batch_sizes[-1]
                and all((s.params.logprobs or 0) <= MAX_LOGPROBS for s in running))

    def plan(self, running: list[Sequence], warm: DeferredGraphs | None) -> StepK:
        """The next decode step's K and bucket for ``running``; the step-by-step path always drafts K_max.
        ``warm``: the runner's warm-up, which compiles a K it deferred when the policy first picks it."""
        bucket = self.nominal_bucket(len(running)) or self.batch_sizes[-1]
        if not self.fused_applies(running):
            return StepK(self.k_max, bucket, fused=False)
        assert warm is not None, "a fused step's K is chosen against the runner's warm-up"
        to_go = max(s.max_tokens - len(s.output_ids) for s in running)
        return StepK(self.k_for(bucket, to_go, warm, in_step_share(running)), bucket, fused=True)

    def k_for(self, bucket: int, to_go: int | None, warm: DeferredGraphs, in_step: float = 1.0) -> int:
        """This step's K for ``bucket``; ``to_go``: tokens the longest running request has left (None: many);
        ``in_step``: the share of its rows plain decoding would keep in step (:func:`in_step_share`). A K whose
        graphs ``warm`` deferred is compiled there (it tells why) before it is returned."""
        deferred = warm.deferred
        if self.force_k is not None:
            k, why = self.force_k, "asked for"
        elif not self.adaptive:
            return self.k_max
        elif self.acceptance.offered[0] < LEARN_DRAFTS or self.learning_steps < LEARN_STEPS:
            # Acceptance is learned only from drafts, and the prior (1/2 a position) can favour K = 0, which would
            # then learn only from explorations. Draft at the best warm drafting K until some have been verified,
            # over steps enough that they are not only the first tokens of the first requests.
            self.learning_steps += 1
            return self.costs.learning_k(bucket, self.acceptance.rates(LEARN_POSITION_DRAFTS), deferred, in_step)
        elif deferred and to_go is not None and to_go < DEFERRED_MIN_TOKENS:
            # what is left of the run would not repay a compile: the K values warm stay the choice
            return self.k_max if 0 in deferred else self._best_warm(bucket, deferred, in_step)
        else:
            if 0 in deferred:
                warm.compile_deferred(0, "acceptance learned: plain decoding is weighed from now on")
            k = self.costs.k_for(bucket, self.acceptance.rates(), in_step)
            if k == 0:  # acceptance is learned from explorations alone now: what they verify must count
                self.acceptance.age()
            why = f"adaptive K expects it to pay at batch {bucket}"
        if k in deferred:
            warm.compile_deferred(k, why)
        return k

    def _best_warm(self, bucket: int, deferred: set[int], in_step: float = 1.0) -> int:
        """The policy's K among the warm ones (the deferred K values' interpolated figures left out)."""
        costs = self.costs.step_seconds.get(bucket)
        if not costs:
            return self.k_max
        warm = {k: c for k, c in costs.items() if k not in deferred}
        return choose_k(warm, self.acceptance.rates(), self.costs.chosen.get(bucket), bucket, in_step=in_step)

    def observe(self, bucket: int, k: int, seconds: float, between: float | None, switched: bool = False) -> None:
        """A fused step of ``bucket`` at K = ``k`` took ``seconds`` (``between``: what ran since the step before,
        None where not known; ``switched``: the first step after a change of K); a forced K teaches nothing."""
        if self.adaptive and self.force_k is None:
            self.costs.observe(bucket, k, seconds, between, switched)

    def observe_switch(self, bucket: int, seconds: float) -> None:
        """A change of K in ``bucket`` cost ``seconds`` (the batch rebuilt, the MTP catch-up) before its step ran."""
        if self.adaptive and self.force_k is None:
            self.costs.observe_switch(bucket, seconds)

    def record(self, num_draft: int, num_accepted: int) -> None:
        """One request's step verified ``num_draft`` drafts and accepted ``num_accepted`` of them."""
        if self.k_max:
            self.acceptance.record(num_draft, num_accepted)

    def chosen(self, buckets: list[int]) -> dict[int, int]:
        """The K each bucket runs at now (fixed K: K_max)."""
        if not self.adaptive:
            return {b: self.k_max for b in buckets}
        return {b: self.costs.chosen.get(b, self.k_max) for b in buckets}
