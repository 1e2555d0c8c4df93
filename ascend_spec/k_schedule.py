"""K per batch size for an engine whose scheduler is not ours (vLLM's): a sweep of every K per bucket, then the K policy.
Steps report their batch, K and seconds, and verified drafts; ``k_for(batch)`` answers once per scheduled step.
"""
from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field

from .k_policy import KPolicy
from .learnings import Learnings

#: clean steps (not the first after a change of K) each K needs in a bucket's sweep before its median stands
SWEEP_STEPS = 4


def nominal_buckets(max_batch: int) -> tuple[int, ...]:
    """Powers of two up to ``max_batch``, and ``max_batch``: the batch sizes K is chosen for (a batch takes the
    smallest bucket at least its size)."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return tuple([*sizes, max(1, max_batch)])


@dataclass
class MeasuredSchedule:
    """K per batch bucket in 0..``k_max``: each bucket first runs every K for ``SWEEP_STEPS`` clean steps (from
    K_max down), which seeds its step costs; from then on the K policy's rule decides (``policy.costs``, the
    running acceptance ``policy.acceptance``), as in our engine. Every K's graphs are compiled at start."""

    k_max: int
    max_batch: int
    policy: KPolicy = field(init=False)
    #: per bucket under its sweep: clean step seconds per K
    sweeps: dict[int, dict[int, list[float]]] = field(default_factory=dict)
    #: steps run per (bucket, K), every step counted (what the schedule did)
    steps: Counter = field(default_factory=Counter)
    #: started from an earlier run's learnings
    seeded: bool = False

    def __post_init__(self) -> None:
        self.policy = KPolicy(self.k_max, adaptive=True, batch_sizes=nominal_buckets(self.max_batch))

    def bucket(self, batch: int) -> int:
        return self.policy.nominal_bucket(batch) or self.policy.batch_sizes[-1]

    def measured(self, bucket: int) -> bool:
        """Whether ``bucket`` has a step cost for every K (its sweep is over, or it was seeded)."""
        return len(self.policy.step_seconds.get(bucket, {})) == self.k_max + 1

    def k_for(self, batch: int, in_step: float = 1.0) -> int:
        """The K to draft in a step of ``batch`` requests (``in_step``: see :func:`.adaptive.rows_apart_cost`).
        The sweep is this schedule's learning phase: it verified drafts at every K, so the policy's own (drafting
        until ``LEARN_DRAFTS`` first drafts were verified, K = 0 never weighed) is not run again."""
        b = self.bucket(batch)
        if self._swept(b):
            k = self.policy.costs.k_for(b, self.policy.acceptance.rates(), in_step)
            if k == 0:  # acceptance is learned from explorations alone now: what they verify must count
                self.policy.acceptance.age()
        else:
            k = self._under_sweep(b)
        self.steps[(b, k)] += 1
        return k

    def observe(self, batch: int, k: int, seconds: float, switched: bool) -> None:
        """A step of ``batch`` requests that drafted K = ``k`` took ``seconds``; ``switched``: it verified the drafts
        of another K (the first step after a change), so its cost is neither K's."""
        b = self.bucket(batch)
        if self.measured(b):
            if switched:
                self.policy.observe_switch(b, max(0.0, seconds - self.policy.step_seconds[b][k]))
            self.policy.observe(b, k, seconds, None, switched)
        elif not switched:
            self.sweeps.setdefault(b, {}).setdefault(k, []).append(seconds)

    def record(self, num_draft: int, num_accepted: int) -> None:
        """One request's step verified ``num_draft`` drafts and accepted ``num_accepted``."""
        self.policy.record(num_draft, num_accepted)

    def seed(self, learned: Learnings) -> None:
        """Start from what an earlier run learned: its acceptance, and each bucket's step costs it measured at every
        K (that bucket skips its sweep)."""
        learned.seed(self.policy)
        self.seeded = True
        for b, costs in learned.step_seconds.items():
            if b in self.policy.batch_sizes and set(costs) == set(range(self.k_max + 1)):
                self.policy.step_seconds[b] = dict(costs)

    def learnings(self) -> Learnings:
        """What this schedule knows now (a seed's included), to be kept for the next run."""
        return Learnings.from_policy(self.policy)

    def chosen(self) -> dict[int, int]:
        """The K each bucket runs now (a bucket under its sweep: the K it sweeps)."""
        return {b: self.policy.costs.chosen.get(b, self._under_sweep(b)) for b in self.policy.batch_sizes}

    def _swept(self, b: int) -> bool:
        if self.measured(b):
            return True
        samples = self.sweeps.get(b, {})
        if any(len(samples.get(k, [])) < SWEEP_STEPS for k in range(self.k_max + 1)):
            return False
        self.policy.step_seconds[b] = {k: statistics.median(samples[k]) for k in range(self.k_max + 1)}
        del self.sweeps[b]
        return True

    def _under_sweep(self, b: int) -> int:
        """The K a bucket's sweep runs: the deepest still short of samples."""
        samples = self.sweeps.get(b, {})
        return next((k for k in range(self.k_max, -1, -1) if len(samples.get(k, [])) < SWEEP_STEPS), self.k_max)
