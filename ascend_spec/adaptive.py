"""Adaptive K: per batch bucket, the number of drafts that gives the most tokens per second.

Speculation pays when the tokens a step yields outgrow what the step costs: with per-position acceptance
a_1..a_K, a step yields ``1 + Σ_j Π_{i≤j} a_i`` tokens and costs ``step_seconds[K]``: measured at warm-up (the same
fused graphs on the same inert batch at a short context, K values interleaved), then followed by the steps the run
takes: a moving average of each step's wall time since the previous one (each clipped at ``OBSERVE_CLIP`` times the
running figure), so what a K costs the engine beyond its graph counts too (speculating requests finish at different
steps and join one by one, each a prefill of its own), and a warm-up figure taken on a noisy machine does not rule
a K out for good. K = 0 — plain decoding — wins where drafts are expected not to pay. The estimates can drift from
what a K really costs (an exploration step is charged the prefill of a request that joins then; the running K's
join spikes are clipped): on the 2-core CI machine at batch 8-16, adaptive K runs below both plain decoding and the
best fixed K (docs/bench/results.md).

Acceptance is learned from the run, and so are the costs: every ``EXPLORE_EVERY`` steps a bucket runs its last two
at another K, each K in turn (the first step drafts, the second verifies), so a K whose warm-up figure was off, or
whose drafts were rejected once, gets measured again.
"""
from __future__ import annotations

from dataclasses import dataclass, field

#: steps between explorations of another K (each costs two steps at a K that may not pay: at batch 16 on CPU a
#: K = 3 step costs twice a plain one, so exploring every 32 steps cost ~6%)
EXPLORE_EVERY = 64
#: consecutive steps an exploration takes: one to draft, one to verify
EXPLORE_STEPS = 2
#: weight of one measured step in a bucket's running step cost (the chosen K: measured every step)
COST_SMOOTHING = 0.2
#: weight of an exploration step (another K, measured two steps in EXPLORE_EVERY): a warm-up figure that was off
#: must not take many explorations to correct
EXPLORE_SMOOTHING = 0.5
#: a step's time counts at most this multiple of its K's running cost: a request that joins (its prefill lands in
#: the step's wall time) costs every K alike and once, and must not make one K look dear until it is explored again
OBSERVE_CLIP = 1.5
#: context (tokens) of the inert batch warm-up times steps on: short, so a K's first figure errs low rather than
#: high; a K that runs is measured every step and corrected at once, one that does not only when explored
WARMUP_COST_CONTEXT = 64


def expected_tokens_per_step(acceptance: list[float], k: int) -> float:
    """1 + Σ_j Π_{i≤j} a_i: the bonus token plus the drafts accepted in a row, a_i = P(draft i accepted | i-1 was)."""
    total, run = 1.0, 1.0
    for a in acceptance[:k]:
        run *= a
        total += run
    return total


def choose_k(step_seconds: dict[int, float], acceptance: list[float]) -> int:
    """The K with the most expected tokens per second; ties go to the smaller K (cheaper when acceptance drifts)."""
    return max(sorted(step_seconds), key=lambda k: (expected_tokens_per_step(acceptance, k) / step_seconds[k], -k))


def speedup_limit(step_seconds: dict[int, float], acceptance: list[float], k: int) -> float:
    """The speed-up over K = 0 these step costs and this acceptance allow: tokens per step ÷ relative step cost."""
    return expected_tokens_per_step(acceptance, k) * step_seconds[0] / step_seconds[k]


@dataclass
class AdaptiveK:
    """K per bucket from measured step costs and the running acceptance (``acceptance()``: a_1..a_Kmax)."""

    k_max: int
    #: seconds of one fused step per bucket and K (warm-up measures them)
    step_seconds: dict[int, dict[int, float]] = field(default_factory=dict)
    #: the K each bucket chose last
    chosen: dict[int, int] = field(default_factory=dict)
    _steps: dict[int, int] = field(default_factory=dict)

    def k_for(self, bucket: int, acceptance: list[float]) -> int:
        costs = self.step_seconds.get(bucket)
        if not costs:
            return self.k_max
        n = self._steps[bucket] = self._steps.get(bucket, 0) + 1
        k = self.chosen[bucket] = choose_k(costs, acceptance)
        if n % EXPLORE_EVERY >= EXPLORE_EVERY - EXPLORE_STEPS:
            # Explore the other K values in turn: each one's cost gets measured on this run's steps, and K_max's
            # turns bring acceptance figures for every position.
            others = [j for j in sorted(costs) if j != k]
            return others[(n // EXPLORE_EVERY) % len(others)] if others else k
        return k

    def observe(self, bucket: int, k: int, seconds: float) -> None:
        """A step of ``bucket`` at K = ``k`` took ``seconds``: fold it into the running cost."""
        costs = self.step_seconds.get(bucket)
        if costs is not None and k in costs:
            weight = COST_SMOOTHING if k == self.chosen.get(bucket, k) else EXPLORE_SMOOTHING
            costs[k] += weight * (min(seconds, OBSERVE_CLIP * costs[k]) - costs[k])
