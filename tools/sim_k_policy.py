"""Adaptive K in a simulated world: how much its own learning, explorations and switches cost, without a machine's
noise in the figure.

The policy under test is the real one (``KPolicy`` with its ``AdaptiveK`` and acceptance tracker); the world is
simulated: each K's step costs a known figure times a slow drift and per-step noise, a change of K costs a share of
a plain step, drafts are accepted at known per-position rates, and a bucket of b rows loses what the policy's own
rows-apart discount says. Warm-up's figures err by ``warm_error`` at K_max (less at lower K, as measured: warm-up
times an inert batch at a short context). Fixed K runs in the same world; a cell's figure is adaptive K's tokens/s
over the best fixed K's (K = 0 included), the median over seeds.

    python tools/sim_k_policy.py [--seeds 16] [--noise 0.1] [--drift 0.3] [--warm-error 0.15] [--switch 0.25]
                                 [--early-acceptance 1.0] [--lone-step 0.0]

``--early-acceptance F`` scales acceptance by F over each run's first 30% of steps (the first prompts poor): at
0.4, K = 0 is the best there and drafting afterwards, so adaptive K must come back from K = 0.
``--lone-step F``: a K's first steps in a row cost F less than its steady ones, so explorations price it cheap
(traced at batch 1: K = 3's explored steps 8.2 ms, 9.0 in a run of its own, 0.09).

The step costs are a bench run's (AVX-512 + AMX, bundled model, equal lengths: ms per step of each fixed K with
the rows-apart loss taken out, which the simulation puts back); acceptance 0.65 / 0.76 / 0.78.
"""
from __future__ import annotations

import argparse
import math
import random
import statistics
from dataclasses import dataclass

from ascend_spec.adaptive import expected_tokens_per_step, rows_apart_cost
from ascend_spec.k_policy import KPolicy

#: ms per step of no-spec and fixed K = 1..3 per batch (tokens/s and tokens a step of `tools/bench.py --twin 2`)
BENCH_MS = {1: (4.08, 6.86, 9.33, 10.65), 2: (7.59, 10.89, 12.29, 12.47), 4: (10.36, 13.59, 16.83, 18.75),
            8: (12.7, 15.55, 20.9, 28.66), 16: (14.95, 25.02, 33.51, 45.63)}
ACCEPTANCE = (0.65, 0.76, 0.78)
#: steps a cell runs (about a bench round's: 16 requests of 128 tokens at batch 1, 64 at the larger ones)
STEPS = {1: 1200, 2: 600, 4: 500, 8: 500, 16: 500}
#: steps over which the machine's speed swings once up and down
DRIFT_PERIOD = 700
#: share of a run's steps that ``World.early_acceptance`` applies to
EARLY_SHARE = 0.3
#: steps in a row after which a K's steps cost their steady figure (``World.lone_step``)
STEADY_AFTER = 8


@dataclass(frozen=True)
class World:
    noise: float = 0.1  # per-step log-normal sigma
    drift: float = 0.3  # amplitude of the slow swing in speed
    warm_error: float = 0.15  # warm-up's figure at K_max is this much under the truth (negative: over)
    switch: float = 0.25  # a change of K, in plain steps
    early_acceptance: float = 1.0  # acceptance × this over a run's first EARLY_SHARE of steps (first prompts)
    lone_step: float = 0.0  # a K's step costs this much less within its first STEADY_AFTER steps in a row


class _NothingDeferred:
    deferred: set[int] = set()


def step_costs(batch: int) -> dict[int, float]:
    """Seconds a step of each K costs in the simulation (the bench's figure less the rows-apart loss)."""
    return {k: ms / 1e3 * (1 - rows_apart_cost(batch, expected_tokens_per_step(list(ACCEPTANCE), k)))
            for k, ms in enumerate(BENCH_MS[batch])}


def tokens_per_s(world: World, batch: int, k_fixed: int | None, seed: int) -> tuple[float, dict[int, int]]:
    """One run of ``STEPS[batch]`` steps at K = ``k_fixed`` (None: adaptive K), and the steps each K ran."""
    rng, costs, late = random.Random(seed), step_costs(batch), list(ACCEPTANCE)
    early = [a * world.early_acceptance for a in late]
    k_max = max(costs)
    policy = KPolicy(k_max, adaptive=True, batch_sizes=(batch,), force_k=k_fixed)
    policy.costs.step_seconds[batch] = {k: c * (1 - world.warm_error * k / k_max) for k, c in costs.items()}
    seconds = tokens = 0.0
    previous, ran, in_a_row = None, {}, 0
    for step in range(STEPS[batch]):
        k = policy.k_for(batch, None, _NothingDeferred())  # type: ignore[arg-type]
        ran[k] = ran.get(k, 0) + 1
        speed = 1 + world.drift * math.sin(2 * math.pi * step / DRIFT_PERIOD)
        switched = previous is not None and k != previous
        in_a_row = 1 if k != previous else in_a_row + 1
        if switched:
            seconds += world.switch * costs[0] * speed
            policy.observe_switch(batch, world.switch * costs[0] * speed)
        acceptance = early if step < EARLY_SHARE * STEPS[batch] else late
        lone = world.lone_step if in_a_row <= STEADY_AFTER else 0.0
        took = costs[k] * (1 - lone) * speed * math.exp(rng.gauss(0, world.noise))
        seconds += took
        policy.observe(batch, k, took, 0.0, switched)
        kept = 1 - rows_apart_cost(batch, expected_tokens_per_step(acceptance, k))
        for _ in range(batch):
            accepted = 0
            while accepted < k and rng.random() < acceptance[accepted]:
                accepted += 1
            policy.record(k, accepted)
            tokens += (1 + accepted) * kept
        previous = k
    return tokens / seconds, ran


def adaptive_vs_best(world: World, seeds: int = 16) -> dict[int, float]:
    """Per batch: adaptive K's tokens/s over the best fixed K's in the same world, the median over seeds."""
    cells = {}
    for batch in BENCH_MS:
        ratios = []
        for seed in range(seeds):
            best = max(tokens_per_s(world, batch, k, seed)[0] for k in range(len(BENCH_MS[batch])))
            ratios.append(tokens_per_s(world, batch, None, seed)[0] / best)
        cells[batch] = statistics.median_high(ratios)
    return cells


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=16)
    for name, value in vars(World()).items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=float, default=value)
    args = ap.parse_args()
    world = World(**{name: getattr(args, name) for name in vars(World())})
    cells = adaptive_vs_best(world, args.seeds)
    print(f"{world}: adaptive ÷ best fixed K per batch "
          + ", ".join(f"{b}: {r:.3f}" for b, r in cells.items())
          + f"; geometric mean {statistics.geometric_mean(cells.values()):.3f}")


if __name__ == "__main__":
    main()
