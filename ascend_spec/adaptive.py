"""Adaptive K: per batch bucket, the number of drafts that gives the most tokens per second.

With per-position acceptance a_1..a_K, a step yields ``1 + Σ_j Π_{i≤j} a_i`` tokens and costs
``step_seconds[K]``: measured at warm-up (the same fused graphs on an inert batch at a short context, K values
interleaved), then followed by the run's own steps (graph and host; prefills are left out of a step's cost).

- What moves every K alike (the machine's drift, the host's share) is followed by the running K: each of its steps
  scales the bucket's figures, so K values that do not run keep no stale warm-up figures.
- What sets one K apart is measured by explorations: every ``EXPLORE_EVERY`` steps a bucket runs two steps at
  another K, each K in turn (one drafts, one verifies); the second moves that K's own figure (the first such step
  replaces its warm-up figure, later ones are averaged; a K that ran counts its steady figure as one such step, as
  others' takeovers and drift leave it stale). A lower K trailing the running one far
  (``FAR_EXPLORE_GAP``) is explored on one of its turns in ``FAR_EXPLORE_LAPS``: all it can learn is its cost.
- What runs between steps (prefills, the engine's loop) is averaged per bucket and K (``between``), drawn towards
  the bucket's average over every K, and added to a step's figure when K is chosen: it differs by K and does not
  follow the drift.
- A running K gives way only to one expected to yield ``SWITCH_MARGIN`` more per second (no flip-flopping at a
  threshold). What a change of K costs (rebuild, catch-up) is timed apart per bucket, widens the margin and
  spaces explorations; the step after a change moves no figure (it runs on the caches the other K left). A K
  that takes over from or to K = 0 on a figure warm-up or explorations set corrects it on its first
  ``TAKEOVER_STEPS`` steady steps, then scales every K's; one back on a figure its own steady steps set scales
  every K's from the first (drift they all share must not push it under the K it took over from).
- A drafting K near the running one on a figure explorations set runs a trial of ``TRIAL_STEPS`` steps in a row every
  ``TRIAL_EVERY`` steps at most, correcting its own figure as a K that took over does; then the K it interrupted
  is the incumbent again, which the tried K must beat by the margin. A drafting K that would take over from
  another on such a figure runs a trial first as well: kept on as the incumbent, it held on by the margin.
- Until ``LEARN_DRAFTS`` drafts are verified over ``LEARN_STEPS`` steps at least, a bucket drafts at its best warm
  drafting K (first the deepest within ``SWITCH_MARGIN`` of it: it learns the most positions) and explores
  nothing: K = 0 would learn nothing, and the K it drafts is then the incumbent the rest of the run must beat.
  Its figures weigh a position offered few drafts (``k_policy.LEARN_POSITION_DRAFTS``) at the rate of the one
  before: a step down stops drafting it.
- A drafting K is discounted by ``rows_apart_cost``: a bucket's rows finish apart when it speculates, a cost no
  step's time shows, in the share of its rows that plain decoding would keep in step (``in_step``). A K = 0 step
  reserves no draft room (the scheduler asks the K policy before it makes room).
- K = 0 is what the policy learns least about: it must win by ``stop_margin(bucket)``, acceptance is a recent
  window (``k_policy.ACCEPTANCE_WINDOW``) that each K = 0 step ages as a draft would, and small buckets explore
  more often while it runs (``explore_every``).

The runs behind each rule and constant: docs/performance.md, "Adaptive K"; what the rules cost in a known world:
tools/sim_k_policy.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

#: steps between explorations of another K (each costs two steps at a K that may not pay)
EXPLORE_EVERY = 64
#: a K below the running one whose expected tokens/s trail its own by more than this share is explored on one
#: turn in ``FAR_EXPLORE_LAPS`` only: such an exploration measures its step cost alone (the running K verifies
#: every position it drafts), and out of K = 0 it pays the MTP catch-up on top (batch 1: K = 0 trailed by 22-25%)
FAR_EXPLORE_GAP = 0.15
FAR_EXPLORE_LAPS = 4
#: ... or, while K = 0 runs in a small bucket, this × bucket steps: out of K = 0 acceptance is learned only there
EXPLORE_ROW_STEPS = 16
#: consecutive steps an exploration takes: one to draft, one to verify
EXPLORE_STEPS = 2
#: weight of one step of the running K: it scales every K's figure of its bucket (drift they all share)
COST_SMOOTHING = 0.2
#: an explored K's n-th measured step weighs 1/n down to this: the first replaces the warm-up figure, later ones
#: average out one step's noise instead of following it. A K's own steady figure counts as one measured step: it
#: goes stale once the K stops running (batch 4, mixed lengths: K = 2 stayed priced 30% over three explorations of
#: 11.4-12.4 ms for rounds, each moving it by this floor)
EXPLORE_SMOOTHING = 0.2
#: steady steps of a K that has just taken over that move its own figure, not every K's: it was priced on
#: explorations, single steps among another K's, which ran under its steady steps (batch 1: K = 3 at 8.2 ms
#: explored, 9.0 ms in a run of its own), so scaling every K by them kept the error and held the K for hundreds of
#: steps
TAKEOVER_STEPS = 16
#: a drafting K near the running one (expected tokens/s within this share below it, or above it by less than the
#: switch margin) whose figure rests on explorations runs a trial: ``TRIAL_STEPS`` steps in a row, which price it
#: as its own steady steps do. Explored steps run among another K's and miss that figure either way (batch 4,
#: mixed lengths: K = 2 explored at 14.0 ms, 11.2 on its own steps). Not K = 0: it must beat a drafting K by
#: ``stop_margin``, more than a trial this near shows at a bucket of one, and its steps age the acceptance
TRIAL_GAP = 0.10
TRIAL_STEPS = TAKEOVER_STEPS
#: steps of a bucket between the starts of two trials: at most TRIAL_GAP × TRIAL_STEPS / TRIAL_EVERY of a run
TRIAL_EVERY = 512
#: a step counts at most this multiple of its K's running cost: one stalled step must not move the figures far
OBSERVE_CLIP = 1.5
#: a running K gives way only to one expected to yield this much more per second: each change costs a rebuild
SWITCH_MARGIN = 0.05
#: ... and a lone request leaves speculation only for this much more (a bucket of b rows: this / b, at least
#: SWITCH_MARGIN): a wrong K = 0 is corrected only by explorations, and the return pays a catch-up
STOP_MARGIN = 0.15
#: pseudo-steps at the bucket's average over every K that each K's ``between`` average starts from: prefills come
#: in lumps, and a K explored on a few steps must not be priced as if nothing ran between its steps
BETWEEN_PRIOR_STEPS = 64
#: first-position drafts verified (at the best drafting K) before K = 0 is weighed and other K values explored:
#: first tokens are a poor sample
LEARN_DRAFTS = 128
#: ... and decode steps run, at least: at batch b the first LEARN_DRAFTS drafts are the first LEARN_DRAFTS / b
#: tokens of the first requests (8 at batch 16), the poorest a request drafts
LEARN_STEPS = 64
#: share of the run explorations may spend on their changes of K (two each)
EXPLORE_SHARE = 0.05
#: steps over which a change of K must repay its own cost when a running K gives way
SWITCH_HORIZON = 64
#: weight of one change of K's time in a bucket's running figure of what a change costs
SWITCH_SMOOTHING = 0.25
#: context (tokens) warm-up times steps on: short, so a K's first figure errs low rather than high
WARMUP_COST_CONTEXT = 64


#: share of a bucket's tokens/s, per token a step yields beyond plain decoding's one, that its rows finishing apart
#: cost (uneven drain, one-by-one prefills, padded attention): the more a step advances a row, the further apart
ROWS_APART_PER_TOKEN = 0.07


def rows_apart_cost(bucket: int, tokens_per_step: float, in_step: float = 1.0) -> float:
    """Share of a drafting K's expected tokens/s that rows finishing apart cost a bucket of ``bucket`` rows whose
    steps yield ``tokens_per_step`` a row, ``in_step`` of which plain decoding would keep in step (requests of one
    token budget): rows whose budgets differ finish apart without drafts too, and drafting costs them nothing
    more that way."""
    return in_step * ROWS_APART_PER_TOKEN * (tokens_per_step - 1) if bucket > 1 else 0.0


def stop_margin(bucket: int) -> float:
    """How much more per second K = 0 must yield than the drafting K running in ``bucket`` to take over."""
    return max(SWITCH_MARGIN, STOP_MARGIN / bucket)


def explore_every(bucket: int, running: int, switch_steps: float = 0.0) -> int:
    """Steps between explorations of a bucket of ``bucket`` rows running at K = ``running``, where a change of K
    costs ``switch_steps`` of its steps: at least as many as keep the two changes an exploration makes within
    ``EXPLORE_SHARE`` of the run."""
    every = EXPLORE_EVERY if running else min(EXPLORE_EVERY, EXPLORE_ROW_STEPS * bucket)
    return max(every, math.ceil(EXPLORE_STEPS * switch_steps / EXPLORE_SHARE))


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
    """The K with the most expected tokens per second in ``bucket``; ties go to the smaller K (cheaper when
    acceptance drifts). With ``current`` (the K running now), another K must beat it by ``SWITCH_MARGIN``, and
    K = 0 must beat a drafting K by ``stop_margin(bucket)``; either margin grows by what the change costs
    (``switch_steps`` of the current K's steps) spread over ``SWITCH_HORIZON`` steps. ``in_step``: see
    :func:`rows_apart_cost`."""
    rate = {k: tokens_per_second(step_seconds, acceptance, k, bucket, in_step) for k in step_seconds}
    best = max(sorted(rate), key=lambda k: (rate[k], -k))
    margin = (stop_margin(bucket) if best == 0 and current else SWITCH_MARGIN) + switch_steps / SWITCH_HORIZON
    if current in rate and current != best and rate[best] < (1 + margin) * rate[current]:
        return current
    return best


def interpolated_costs(measured: dict[int, float], ks: list[int]) -> dict[int, float]:
    """Step costs of ``ks`` between K = 0 and K_max (both measured) on the line through them: the tokens a step
    verifies and drafts grow with K, and the per-step work grows no faster (bundled model, batch 1: K = 0..3 at
    3.33, 4.75, 6.23, 6.91 ms), so an interpolated K errs cheap. A K that looks best on it is compiled and timed
    before it runs; one that does not is not worth a compile."""
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
    #: seconds of one fused step per bucket and K (warm-up measures them)
    step_seconds: dict[int, dict[int, float]] = field(default_factory=dict)
    #: the K each bucket chose last
    chosen: dict[int, int] = field(default_factory=dict)
    #: seconds between two steps (prefills, the engine's loop) per bucket and K, summed over the steps each K ran,
    #: and those steps' count
    between_seconds: dict[int, dict[int, float]] = field(default_factory=dict)
    between_steps: dict[int, dict[int, int]] = field(default_factory=dict)
    #: explored steps per bucket and K since its figure last rested on its own steady steps (which count as one):
    #: an explored step's weight
    measured: dict[int, dict[int, int]] = field(default_factory=dict)
    #: seconds a change of K costs per bucket (the batch rebuilt, the MTP catch-up out of K = 0): a running figure
    switch_seconds: dict[int, float] = field(default_factory=dict)
    #: K values whose figures are interpolated (their graphs deferred at start-up): never explored; the runner
    #: compiles and times one the policy picks
    pending: set[int] = field(default_factory=set)
    #: the K each bucket's last k_for gave as an exploration (None: its running K), until that step is observed
    _exploring: dict[int, int | None] = field(default_factory=dict)
    #: steps each bucket ran since its last exploration ended, and the explorations it made (whose turn is next)
    _since: dict[int, int] = field(default_factory=dict)
    _explorations: dict[int, int] = field(default_factory=dict)
    #: the K each bucket's exploration window under way runs (None: this turn is skipped), chosen at its first step
    _window: dict[int, int | None] = field(default_factory=dict)
    #: steady steps left per bucket in which the K that took over corrects its own figure (``TAKEOVER_STEPS``)
    _taking_over: dict[int, int] = field(default_factory=dict)
    #: K values per bucket whose figure rests on their own steady steps (run, and not explored since)
    _steady: dict[int, set[int]] = field(default_factory=dict)
    #: per bucket under a trial: the K it interrupted, and the trial's steps left to run
    _trial: dict[int, tuple[int, int]] = field(default_factory=dict)
    #: steps each bucket ran since its last trial began
    _since_trial: dict[int, int] = field(default_factory=dict)

    def restart(self) -> None:
        """Forget each bucket's choice and any trial under way; the step costs stay."""
        self.chosen.clear()
        self._trial.clear()

    def between(self, bucket: int, k: int) -> float:
        """Seconds a step of ``bucket`` at K = ``k`` is expected to wait on what runs between steps: its own steps'
        average, drawn towards the bucket's average over every K by ``BETWEEN_PRIOR_STEPS`` pseudo-steps."""
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
        """The K ``bucket`` drafts while acceptance is learned: the best drafting K for the figures so far among the
        warm ones (not ``deferred``), K_max where none is measured. K = 0 would learn nothing, and explorations wait
        for the acceptance they weigh; the choice is the bucket's incumbent, so it changes only for a better K.
        The first choice goes to the deepest K that none beats by ``SWITCH_MARGIN``: only positions a K drafts
        are learned, and under the prior (1/2 a position, which deep positions copy) a lower K looks as good."""
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
        """This step's K for ``bucket``, ``in_step`` of whose rows plain decoding would keep in step (see
        :func:`rows_apart_cost`)."""
        costs = self.step_seconds.get(bucket)
        if not costs:
            return self.k_max
        self._exploring[bucket] = None
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
                return self._start_trial(bucket, current, k)
            else:
                self._taking_over[bucket] = TAKEOVER_STEPS
        every = explore_every(bucket, k, self.switch_steps(bucket, k))
        if since_trial >= TRIAL_EVERY and since <= every - EXPLORE_STEPS:
            tried = self._tried(bucket, k, total, acceptance, in_step)
            self._since_trial[bucket] = 0 if tried is not None else TRIAL_EVERY - EXPLORE_EVERY  # look again later
            if tried is not None:
                return self._start_trial(bucket, k, tried)
        if since > every - EXPLORE_STEPS:
            # Explore the other K values in turn: each one's cost gets measured on this run's steps, and K_max's
            # turns bring acceptance figures for every position. Counted from the last exploration, so a change
            # of ``every`` (K = 0 explores more often) neither skips one nor runs two back to back.
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

    def _start_trial(self, bucket: int, back: int, tried: int) -> int:
        """Run ``tried`` for ``TRIAL_STEPS`` steps in ``bucket``, correcting its own figure, then ``back`` again."""
        self._trial[bucket] = (back, TRIAL_STEPS - 1)
        self._taking_over[bucket] = TRIAL_STEPS - 1  # its first step is a change's: it moves nothing
        self.chosen[bucket] = tried
        return tried

    def _explored(self, bucket: int, running: int, total: dict[int, float], acceptance: list[float],
                  in_step: float) -> int | None:
        """The K this exploration window of ``bucket`` runs (``total``: each K's step and between figures), or
        None: a lower K trailing the running one by more than ``FAR_EXPLORE_GAP`` whose turn is not in its lap."""
        others = [j for j in sorted(total) if j != running and j not in self.pending]
        if not others:
            return None
        turn = self._explorations.get(bucket, 0)
        k = others[turn % len(others)]
        if k > running or turn // len(others) % FAR_EXPLORE_LAPS == 0:
            return k
        rate = {j: tokens_per_second(total, acceptance, j, bucket, in_step) for j in (k, running)}
        return k if rate[k] >= (1 - FAR_EXPLORE_GAP) * rate[running] else None

    def _tried(self, bucket: int, running: int, total: dict[int, float], acceptance: list[float],
               in_step: float) -> int | None:
        """The K a trial of ``bucket`` runs now: the best drafting one near ``running`` (``TRIAL_GAP``) whose figure
        is not its own steady steps', or None."""
        steady = self._steady.get(bucket, set())
        rate = {j: tokens_per_second(total, acceptance, j, bucket, in_step) for j in total
                if j == running or (j and j not in steady and j not in self.pending)}
        near = [j for j in rate if j != running and rate[j] >= (1 - TRIAL_GAP) * rate[running]]
        return max(near, key=lambda j: (rate[j], -j)) if near else None

    def observe(self, bucket: int, k: int, seconds: float, between: float | None = None,
                switched: bool = False) -> None:
        """A step of ``bucket`` at K = ``k`` took ``seconds``, and ``between`` more since the step before (None: not
        known, or K changed). An explored K's step moves its own figure, as do the first ``TAKEOVER_STEPS`` steady
        steps of a K that took over; any other step's scales every K's figure (drift they share). ``between`` adds
        to this K's own average of what runs between steps. The first step after a change of K (``switched``)
        moves nothing: it runs on the caches the other K left, so its time is the change's, and an exploration's
        first step would price its K too dear."""
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
