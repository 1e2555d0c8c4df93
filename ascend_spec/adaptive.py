"""Adaptive K: per batch bucket, the number of drafts K in 0..K_max with the most expected tokens per second.
Step costs come from warm-up and the run's own steps; acceptance from the K policy's running window.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

# Each constant's reason and the runs that set it: docs/performance.md, "Tuned constants".
# Explorations: every EXPLORE_EVERY steps (while K = 0 runs, EXPLORE_ROW_STEPS × bucket at most), EXPLORE_STEPS
# steps at another K; a lower K trailing by FAR_EXPLORE_GAP only one lap in FAR_EXPLORE_LAPS; a higher K trailing
# so even at full acceptance only as often as keeps what its steps cost beyond the running K's within
# FAR_EXPLORE_SHARE of the run; changes of K they cause stay within EXPLORE_SHARE of the run.
EXPLORE_EVERY = 128
EXPLORE_ROW_STEPS = 16
EXPLORE_STEPS = 2
FAR_EXPLORE_GAP = 0.15
FAR_EXPLORE_LAPS = 4
FAR_EXPLORE_SHARE = 0.01
EXPLORE_SHARE = 0.05
# Figures: a steady step weighs COST_SMOOTHING in every K's; an explored K's n-th step 1/n down to
# EXPLORE_SMOOTHING; a step counts at most OBSERVE_CLIP × its K's cost (one stall must not move them far).
COST_SMOOTHING = 0.2
EXPLORE_SMOOTHING = 0.2
OBSERVE_CLIP = 1.5
# Takeovers and trials: the first TAKEOVER_STEPS steady steps of a new K move its own figure only; a drafting K
# within TRIAL_GAP, priced on explorations, runs TRIAL_STEPS in a row, at most once in TRIAL_EVERY steps.
TAKEOVER_STEPS = 16
TRIAL_GAP = 0.10
TRIAL_STEPS = TAKEOVER_STEPS
TRIAL_EVERY = 1024
# Margins: another K must yield SWITCH_MARGIN more per second (K = 0: STOP_MARGIN / bucket, at least that), plus
# a change's cost (its figure weighted SWITCH_SMOOTHING) repaid over SWITCH_HORIZON steps.
SWITCH_MARGIN = 0.05
STOP_MARGIN = 0.15
SWITCH_HORIZON = 64
SWITCH_SMOOTHING = 0.25
#: pseudo-steps at the bucket's average each K's ``between`` average starts from (prefills come in lumps)
BETWEEN_PRIOR_STEPS = 64
#: first-position drafts verified, and steps run, before K = 0 is weighed and other K values explored
LEARN_DRAFTS = 128
LEARN_STEPS = 64
#: context warm-up times steps on: short, so a first figure errs low
WARMUP_COST_CONTEXT = 64
#: tokens/s share lost to rows finishing apart, per token a step yields beyond one
ROWS_APART_PER_TOKEN = 0.07


def rows_apart_cost(bucket: int, tokens_per_step: float, in_step: float = 1.0) -> float:
    """Share of a drafting K's tokens/s lost to rows finishing apart; ``in_step``: rows plain decoding keeps in step."""
    return in_step * ROWS_APART_PER_TOKEN * (tokens_per_step - 1) if bucket > 1 else 0.0


def stop_margin(bucket: int) -> float:
    """How much more per second K = 0 must yield than the drafting K running in ``bucket`` to take over."""
    return max(SWITCH_MARGIN, STOP_MARGIN / bucket)


def explore_every(bucket: int, running: int, switch_steps: float = 0.0) -> int:
    """Steps between explorations: enough to keep an exploration's two changes of K within ``EXPLORE_SHARE``."""
    every = EXPLORE_EVERY if running else min(EXPLORE_EVERY, EXPLORE_ROW_STEPS * bucket)
    return max(every, math.ceil(EXPLORE_STEPS * switch_steps / EXPLORE_SHARE))


def far_explore_every(total: dict[int, float], running: int, k: int, switch_steps: float = 0.0) -> int:
    """Steps between explorations of a higher K ``k`` that trails ``running`` far even at full acceptance: what the
    explorations of every K above ``running`` cost beyond the running K's steps (their own, and two changes of K
    each) within ``FAR_EXPLORE_SHARE``, this K's share of it the same as each other's."""
    extra = EXPLORE_STEPS * max(0.0, total[k] / total[running] - 1) + 2 * switch_steps
    return math.ceil(extra * sum(1 for j in total if j > running) / FAR_EXPLORE_SHARE)


def expected_tokens_per_step(acceptance: list[float], k: int) -> float:
    """1 + Σ_j Π_{i≤j} a_i: the bonus token plus the drafts accepted in a row, a_i = P(draft i accepted | i-1 was)."""
    total, run = 1.0, 1.0
    for a in acceptance[:k]:
        run *= a
        total += run
    return total


def tokens_per_second(step_seconds: dict[int, float], acceptance: list[float], k: int, bucket: int = 1,
                      in_step: float = 1.0) -> float:
    """Expected tokens per second of a step at K = ``k``, less what rows finishing apart cost."""
    tokens = expected_tokens_per_step(acceptance, k)
    return tokens / step_seconds[k] * (1 - rows_apart_cost(bucket, tokens, in_step))


def choose_k(step_seconds: dict[int, float], acceptance: list[float], current: int | None = None,
             bucket: int = 1, switch_steps: float = 0.0, in_step: float = 1.0) -> int:
    """The K with the most expected tokens/s; ties go to the smaller K. Another K must beat ``current`` by
    ``SWITCH_MARGIN`` (K = 0: ``stop_margin``), plus the change's cost spread over ``SWITCH_HORIZON`` steps."""
    rate = {k: tokens_per_second(step_seconds, acceptance, k, bucket, in_step) for k in step_seconds}
    best = max(sorted(rate), key=lambda k: (rate[k], -k))
    margin = (stop_margin(bucket) if best == 0 and current else SWITCH_MARGIN) + switch_steps / SWITCH_HORIZON
    if current in rate and current != best and rate[best] < (1 + margin) * rate[current]:
        return current
    return best


def interpolated_costs(measured: dict[int, float], ks: list[int]) -> dict[int, float]:
    """Step costs of ``ks`` on the line through K = 0 and K_max: a step's cost grows no faster than linearly in K,
    so an interpolated K errs cheap (one that looks best is compiled and timed before it runs)."""
    k_max = max(measured)
    c0, c_max = measured[0], measured[k_max]
    return {k: c0 + (c_max - c0) * k / k_max for k in ks}


def speedup_limit(step_seconds: dict[int, float], acceptance: list[float], k: int) -> float:
    """The speed-up over K = 0 these step costs and this acceptance allow: tokens per step ÷ relative step cost."""
    return expected_tokens_per_step(acceptance, k) * step_seconds[0] / step_seconds[k]


@dataclass
class AdaptiveK:
    """K per bucket from measured step costs and the running acceptance (``acceptance()``: a_1..a_Kmax)."""

    k_max: int
    step_seconds: dict[int, dict[int, float]] = field(default_factory=dict)
    chosen: dict[int, int] = field(default_factory=dict)
    #: per bucket and K: seconds between steps summed over each K's steps, and their count
    between_seconds: dict[int, dict[int, float]] = field(default_factory=dict)
    between_steps: dict[int, dict[int, int]] = field(default_factory=dict)
    #: explored steps per bucket and K since its figure last rested on its steady steps (which count as one)
    measured: dict[int, dict[int, int]] = field(default_factory=dict)
    switch_seconds: dict[int, float] = field(default_factory=dict)
    #: K values with interpolated figures (graphs deferred): never explored; compiled and timed when picked
    pending: set[int] = field(default_factory=set)
    #: the K each bucket's last k_for gave as an exploration (None: its running K), until observed
    _exploring: dict[int, int | None] = field(default_factory=dict)
    _since: dict[int, int] = field(default_factory=dict)
    _explorations: dict[int, int] = field(default_factory=dict)
    #: the K of each bucket's exploration window under way (None: this turn is skipped)
    _window: dict[int, int | None] = field(default_factory=dict)
    _taking_over: dict[int, int] = field(default_factory=dict)
    _steady: dict[int, set[int]] = field(default_factory=dict)
    #: per bucket under a trial: the K it interrupted, and the steps left
    _trial: dict[int, tuple[int, int]] = field(default_factory=dict)
    _since_trial: dict[int, int] = field(default_factory=dict)
    #: steps each bucket asked for a K, and per (bucket, K) the step a far higher K was last explored (or first
    #: found far)
    _steps: dict[int, int] = field(default_factory=dict)
    _far_explored: dict[tuple[int, int], int] = field(default_factory=dict)
    #: per (bucket, K) the step its last trial began
    _tried_at: dict[tuple[int, int], int] = field(default_factory=dict)

    def restart(self) -> None:
        """Forget each bucket's choice and any trial under way; the step costs stay."""
        self.chosen.clear()
        self._trial.clear()

    def resume(self, bucket: int, k: int) -> None:
        """Start ``bucket`` on K = ``k``, the K an earlier run ran most there (a start from its learnings), unless
        the bucket chose already: its figure counts as set by steady steps, so another K takes over as from a
        running K (a drafting K priced on explorations runs a trial first) instead of on figures alone."""
        if bucket not in self.chosen and k not in self.pending:
            self.chosen[bucket] = k
            self._steady.setdefault(bucket, set()).add(k)

    def between(self, bucket: int, k: int) -> float:
        """Expected seconds between steps at K = ``k``: its average, drawn towards the bucket's (``BETWEEN_PRIOR_STEPS``)."""
        sums, steps = self.between_seconds.get(bucket, {}), self.between_steps.get(bucket, {})
        pooled = sum(sums.values()) / sum(steps.values()) if steps else 0.0
        return (sums.get(k, 0.0) + BETWEEN_PRIOR_STEPS * pooled) / (steps.get(k, 0) + BETWEEN_PRIOR_STEPS)

    def switch_steps(self, bucket: int, k: int | None) -> float:
        """What a change of K costs ``bucket``, in steps of K = ``k`` (0 before one was timed)."""
        cost = self.step_seconds.get(bucket, {}).get(k) if k is not None else None
        return self.switch_seconds.get(bucket, 0.0) / cost if cost else 0.0

    def observe_switch(self, bucket: int, seconds: float) -> None:
        """A change of K in ``bucket`` cost ``seconds`` before its step ran."""
        seen = self.switch_seconds.get(bucket)
        self.switch_seconds[bucket] = seconds if seen is None else seen + SWITCH_SMOOTHING * (seconds - seen)

    def learning_k(self, bucket: int, acceptance: list[float], deferred: set[int], in_step: float = 1.0) -> int:
        """The K ``bucket`` drafts while acceptance is learned: the best warm drafting K, kept as the incumbent; first
        the deepest none beats by ``SWITCH_MARGIN``, as only positions a K drafts are learned."""
        costs = self.step_seconds.get(bucket, {})
        drafting = {j: c + self.between(bucket, j) for j, c in costs.items() if j and j not in deferred}
        if not drafting:
            return self.k_max
        current = self.chosen.get(bucket)
        if current is None:  # the first choice: of the K values none beats by SWITCH_MARGIN, the one learning most
            current = max(j for j in drafting if choose_k(drafting, acceptance, j, bucket, in_step=in_step) == j)
        self.chosen[bucket] = choose_k(drafting, acceptance, current, bucket, self.switch_steps(bucket, current),
                                       in_step)
        return self.chosen[bucket]

    def k_for(self, bucket: int, acceptance: list[float], in_step: float = 1.0) -> int:
        """This step's K for ``bucket`` (``in_step``: see :func:`rows_apart_cost`)."""
        costs = self.step_seconds.get(bucket)
        if not costs:
            return self.k_max
        self._exploring[bucket] = None
        self._steps[bucket] = self._steps.get(bucket, 0) + 1
        if bucket in self._trial:
            back, left = self._trial[bucket]
            if left:
                self._trial[bucket] = (back, left - 1)
                return self.chosen[bucket]
            del self._trial[bucket]
            self.chosen[bucket] = back
        since = self._since[bucket] = self._since.get(bucket, 0) + 1
        since_trial = self._since_trial[bucket] = self._since_trial.get(bucket, 0) + 1
        total = {j: c + self.between(bucket, j) for j, c in costs.items()}
        current = self.chosen.get(bucket)
        drafting = {j: c for j, c in total.items() if j}
        if current is None and drafting:  # the first choice: the best drafting K is the incumbent K = 0 must beat
            current = choose_k(drafting, acceptance, None, bucket, in_step=in_step)
        k = self.chosen[bucket] = choose_k(total, acceptance, current, bucket, self.switch_steps(bucket, current),
                                           in_step)
        if current is not None and k != current:
            if k in self._steady.get(bucket, ()):  # back on a figure its own steady steps set: no correction
                self._taking_over[bucket] = 0
            elif k and current:  # a drafting K priced by warm-up or explorations: a trial, then beat ``current``
                if self._trial_due(bucket, k):
                    return self._start_trial(bucket, current, k)
                k = self.chosen[bucket] = current  # its last trial is recent: explorations alone do not repeat it
            else:
                self._taking_over[bucket] = TAKEOVER_STEPS
        every = explore_every(bucket, k, self.switch_steps(bucket, k))
        if since_trial >= TRIAL_EVERY and since <= every - EXPLORE_STEPS:
            tried = self._tried(bucket, k, total, acceptance, in_step)
            self._since_trial[bucket] = 0 if tried is not None else TRIAL_EVERY - EXPLORE_EVERY  # look again later
            if tried is not None:
                return self._start_trial(bucket, k, tried)
        if since > every - EXPLORE_STEPS:
            # Counted from the last exploration, so a change of ``every`` neither skips one nor runs two back to back.
            if since == every - EXPLORE_STEPS + 1 or bucket not in self._window:
                self._window[bucket] = self._explored(bucket, k, total, acceptance, in_step)
            explored = self._window[bucket]
            if explored is not None:
                k = self._exploring[bucket] = explored
            if since >= every:
                self._since[bucket] = 0
                self._explorations[bucket] = self._explorations.get(bucket, 0) + 1
                del self._window[bucket]
        return k

    def _trial_due(self, bucket: int, k: int) -> bool:
        """Whether K = ``k`` may run a trial in ``bucket``: its last one began ``TRIAL_EVERY`` steps ago or more."""
        return self._steps[bucket] - self._tried_at.get((bucket, k), -TRIAL_EVERY) >= TRIAL_EVERY

    def _start_trial(self, bucket: int, back: int, tried: int) -> int:
        """Run ``tried`` for ``TRIAL_STEPS`` steps in ``bucket``, correcting its own figure, then ``back`` again."""
        self._trial[bucket] = (back, TRIAL_STEPS - 1)
        self._tried_at[(bucket, tried)] = self._steps[bucket]
        self._taking_over[bucket] = TRIAL_STEPS - 1  # its first step is a change's: it moves nothing
        self.chosen[bucket] = tried
        return tried

    def _explored(self, bucket: int, running: int, total: dict[int, float], acceptance: list[float],
                  in_step: float) -> int | None:
        """The K this exploration window runs, or None: a far-trailing K off its turn."""
        others = [j for j in sorted(total) if j != running and j not in self.pending]
        if not others:
            return None
        turn = self._explorations.get(bucket, 0)
        k = others[turn % len(others)]
        rate = tokens_per_second(total, acceptance, running, bucket, in_step)
        if k > running:
            # A higher K is explored for the deep positions' acceptance, which only it verifies: it keeps every turn
            # unless it would trail far even with every draft accepted (a verify costing several decode steps);
            # then no acceptance makes it pay, and only a change of costs could: checked at a bounded price.
            best = tokens_per_second(total, [1.0] * len(acceptance), k, bucket, in_step=0.0)
            if best >= (1 - FAR_EXPLORE_GAP) * rate:
                return k
            now = self._steps.get(bucket, 0)
            last = self._far_explored.setdefault((bucket, k), now)
            if now - last < far_explore_every(total, running, k, self.switch_steps(bucket, running)):
                return None
            self._far_explored[(bucket, k)] = now
            return k
        if turn // len(others) % FAR_EXPLORE_LAPS == 0:
            return k
        return k if tokens_per_second(total, acceptance, k, bucket, in_step) >= (1 - FAR_EXPLORE_GAP) * rate else None

    def _tried(self, bucket: int, running: int, total: dict[int, float], acceptance: list[float],
               in_step: float) -> int | None:
        """The best drafting K within ``TRIAL_GAP`` of ``running`` not priced by its own steady steps and whose trial is
        due (:meth:`_trial_due`), or None."""
        steady = self._steady.get(bucket, set())
        rate = {j: tokens_per_second(total, acceptance, j, bucket, in_step) for j in total
                if j == running or (j and j not in steady and j not in self.pending and self._trial_due(bucket, j))}
        near = [j for j in rate if j != running and rate[j] >= (1 - TRIAL_GAP) * rate[running]]
        return max(near, key=lambda j: (rate[j], -j)) if near else None

    def observe(self, bucket: int, k: int, seconds: float, between: float | None = None,
                switched: bool = False) -> None:
        """A step of ``bucket`` at K = ``k`` took ``seconds``, ``between`` more since the one before (None: unknown).
        The first step after a change of K (``switched``) moves nothing: it runs on the caches the other K left."""
        costs = self.step_seconds.get(bucket)
        if costs is None or k not in costs:
            return
        if switched:
            self._exploring.pop(bucket, None)
            return
        if between is not None:
            sums, steps = self.between_seconds.setdefault(bucket, {}), self.between_steps.setdefault(bucket, {})
            sums[k] = sums.get(k, 0.0) + between
            steps[k] = steps.get(k, 0) + 1
        seen = min(seconds, OBSERVE_CLIP * costs[k])
        measured = self.measured.setdefault(bucket, {})
        steady = self._steady.setdefault(bucket, set())
        if k == self._exploring.pop(bucket, None):  # one step per k_for: the next is the running K's unless told
            measured[k] = measured.get(k, 0) + 1
            costs[k] += max(EXPLORE_SMOOTHING, 1 / measured[k]) * (seen - costs[k])
            steady.discard(k)
            return
        if self._taking_over.get(bucket) and k == self.chosen.get(bucket):
            self._taking_over[bucket] -= 1
            costs[k] += COST_SMOOTHING * (seen - costs[k])
        else:
            scale = 1 + COST_SMOOTHING * (seen / costs[k] - 1)
            for j in costs:
                costs[j] *= scale
        if k == self.chosen.get(bucket):
            steady.add(k)
            measured[k] = 1
