"""The micro-benchmarks in tools/ still run against today's modules (one of them had lost an import it needed)."""
from __future__ import annotations

import random
import statistics
import subprocess
import sys

import pytest

from .conftest import TOOLS, amx_cpu, tool_module


def run_tool(script: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, str(TOOLS / script), *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stderr[-3000:]}"
    return proc.stdout


def table_rows(out: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("|---")]


def test_bench_gemm_times_every_kernel_per_token_count():
    header, *rows = table_rows(run_tool("bench_gemm.py", "--tokens", "1", "4", "--repeats", "2"))
    assert header == ["M", "MKL x·Wᵀ", "MKL W·xᵀ (engine)", "oneDNN prepacked"]
    assert [r[0] for r in rows] == ["1", "4"]
    # each cell: milliseconds and the ratio to M = 1 on the same kernel, which is 1 for M = 1
    assert all(cell.endswith("(1.00×)") for cell in rows[0][1:])
    assert all(float(cell.split()[0]) > 0 for row in rows for cell in row[1:])


@pytest.mark.slow
def test_bench_moe_runs_a_shape():
    rows = table_rows(run_tool("bench_moe.py", "--experts", "16", "--topk", "2", "--tokens", "2", "--repeats", "1"))
    assert any(r[:3] == ["16", "2", "2"] for r in rows), rows


def bench_module():
    return tool_module("bench")


def test_probe_splits_steps_into_runs_of_one_k_at_each_change():
    """``probe_k_switch.py --after-change`` times the first steps after each change of K: a run starts where K
    changes or the runner flags a switch (the same K rebuilt after another between two observed steps)."""
    steps = [(1, 1.0, False), (1, 1.1, False), (2, 2.0, True), (2, 2.1, False), (2, 2.2, True), (0, 0.5, True)]
    assert tool_module("probe_k_switch").runs_of_k(steps) == [(1, [1.0, 1.1]), (2, [2.0, 2.1]), (2, [2.2]),
                                                              (0, [0.5])]


def test_bench_rotates_the_contenders_so_each_runs_once_in_every_place():
    turn_order = bench_module().turn_order
    names = ["no-spec", "K=1", "K=2", "adaptive"]
    orders = [turn_order(names, t) for t in range(7, 7 + len(names))]
    assert all(sorted(o) == sorted(names) for o in orders)
    for place in range(len(names)):
        assert sorted(o[place] for o in orders) == sorted(names), orders


def test_bench_request_lengths_are_equal_or_spread_the_same_way_for_every_contender():
    lengths_for = bench_module().lengths_for
    assert lengths_for(5, 128, 0) == [128] * 5
    spread = lengths_for(64, 128, 64)
    assert spread == lengths_for(64, 128, 64)  # a fixed draw: every contender serves the same budgets
    assert all(64 <= n <= 192 for n in spread) and len(set(spread)) > 16


def test_bench_reports_adaptive_against_the_best_other_contender_per_batch():
    versus = bench_module().against_best([
        {"batch": 1, "contender": "no-spec", "vs_no_spec": 1.0}, {"batch": 1, "contender": "K=2", "vs_no_spec": 1.5},
        {"batch": 1, "contender": "adaptive", "vs_no_spec": 1.2},
        {"batch": 8, "contender": "no-spec", "vs_no_spec": 1.0}, {"batch": 8, "contender": "K=2", "vs_no_spec": 0.95},
        {"batch": 8, "contender": "adaptive", "vs_no_spec": 1.01}])
    assert [(v["batch"], v["best"]) for v in versus] == [(1, "K=2"), (8, "no-spec")]
    assert [round(v["ratio"], 3) for v in versus] == [0.8, 1.01]


def test_bench_measures_a_twin_as_adaptive_and_never_counts_it_the_best():
    """``--twin 2`` runs K = 2 twice: the second run is set against the best as adaptive K is (the noise floor of
    adaptive ÷ best), and neither it nor adaptive K is ever the best another is measured against."""
    bench = bench_module()
    twin = bench.twin_name(2)
    rows = [{"batch": 4, "contender": name, "vs_no_spec": v}
            for name, v in (("no-spec", 1.0), ("K=1", 1.2), ("K=2", 1.3), (twin, 1.4), ("adaptive", 1.26))]
    assert bench.against_best(rows) == [{"batch": 4, "best": "K=2", "ratio": pytest.approx(1.26 / 1.3)}]
    assert bench.against_best(rows, twin) == [{"batch": 4, "best": "K=2", "ratio": pytest.approx(1.4 / 1.3)}]


def test_bench_picks_the_best_on_the_other_rounds_for_each_round():
    """Per round, the best is the contender with the best median × no-spec over the other rounds, and the round's
    ratio is that of the two runs of this round; the figure is the median of the rounds' ratios."""
    bench = bench_module()
    tokens = {"no-spec": (100, 100, 100), "K=1": (120, 120, 100), "K=2": (110, 110, 130), "adaptive": (115, 125, 125)}
    runs = {name: [bench.Tally(tokens=t, seconds=1.0) for t in per_round] for name, per_round in tokens.items()}
    # round 0 and 1 are set against K=2 (1.2 over the rounds left, K=1 1.1), round 2 against K=1 (1.2, K=2 1.1)
    assert bench.against_held_out_best(runs) == pytest.approx(125 / 110)
    assert bench.against_held_out_best({name: r[:1] for name, r in runs.items()}) is None  # one round


def test_a_copy_of_a_contender_comes_to_1x_the_best_picked_on_the_other_rounds():
    """Contenders equally fast, each run ±5% noise: picked on the rounds it is measured in, the best is one that rose
    by noise, and a copy of a contender comes out low; picked on the other rounds, it does not."""
    bench = bench_module()
    rng = random.Random(0)
    names = ["no-spec", "K=1", "K=2", "K=3", bench.twin_name(2)]
    same_rounds, held_out = [], []
    for _ in range(100):
        runs = {n: [bench.Tally(tokens=int(1e4 * rng.lognormvariate(0, 0.05)), seconds=1.0) for _ in range(6)]
                for n in names}
        rows = [{"batch": 1, "contender": n, "vs_no_spec": bench.per_round_ratio(runs[n], runs["no-spec"])}
                for n in names]
        same_rounds.append(bench.against_best(rows, names[-1])[0]["ratio"])
        held_out.append(bench.against_held_out_best(runs, names[-1]))
    assert statistics.geometric_mean(same_rounds) < 0.98
    assert statistics.geometric_mean(held_out) == pytest.approx(1.0, abs=0.01)


def noisy_runs(bench, rounds: int, rng: random.Random, adaptive: float = 0.9) -> dict:  # noqa: ANN001 - a module
    """Runs of ``rounds`` rounds whose machine speed swings 1.5x from round to round and each contender's run is ±5%
    on its own: K=2 is the best (1.3x no-spec), adaptive ``adaptive`` of it in each round."""
    truth = {"no-spec": 1.0, "K=1": 1.1, "K=2": 1.3, "adaptive": 1.3 * adaptive}
    speeds = [rng.uniform(0.8, 1.2) for _ in range(rounds)]
    return {n: [bench.Tally(tokens=1e4 * rate * speed * rng.lognormvariate(0, 0.05), seconds=1.0) for speed in speeds]
            for n, rate in truth.items()}


def test_a_cells_interval_keeps_a_rounds_runs_together_and_narrows_with_rounds():
    """The bootstrap draws rounds, not runs: where adaptive is 0.9x the best in every round, however far the rounds
    lie apart, every draw gives 0.9x; with noise of its own the interval holds the cell's figure and narrows as
    rounds are added."""
    bench = bench_module()
    rng = random.Random(0)
    runs = noisy_runs(bench, 6, rng)
    runs["adaptive"] = [bench.Tally(tokens=0.9 * t.tokens, seconds=1.0) for t in runs["K=2"]]
    assert bench.interval_vs_best(runs) == pytest.approx((0.9, 0.9))
    widths = {}
    for rounds in (6, 24):
        width = []
        for _ in range(20):
            runs = noisy_runs(bench, rounds, rng)
            rows = [{"batch": 1, "contender": n, "vs_no_spec": bench.per_round_ratio(runs[n], runs["no-spec"])}
                    for n in runs]
            low, high = bench.interval_vs_best(runs, draws=400)
            assert low <= bench.against_best(rows)[0]["ratio"] <= high
            width.append(high - low)
        widths[rounds] = statistics.median(width)
    assert 0.02 < widths[24] < 0.7 * widths[6]
    assert bench.interval_vs_best({n: r[:1] for n, r in runs.items()}) is None  # one round


def test_a_cells_interval_holds_the_truth_in_most_runs():
    """Adaptive 0.9x the best, each run ±5%: the 90% interval of six rounds holds 0.9 in most runs."""
    bench = bench_module()
    rng = random.Random(1)
    held = [low <= 0.9 <= high for low, high in (bench.interval_vs_best(noisy_runs(bench, 6, rng), draws=400)
                                                 for _ in range(100))]
    assert sum(held) >= 75


def report(bench, runs: dict, **meta) -> dict:  # noqa: ANN001 - a module
    """A bench report (``results.json``) of one batch's ``runs``."""
    return {"meta": {"machine": "cpu", "max_tokens": 128, "length_spread": 64, "twin": 2, **meta},
            "end_to_end": [{"batch": 4, "contender": n, "tokens_per_s_per_round": [t.tokens_per_s for t in ts]}
                           for n, ts in runs.items()]}


def test_pooled_reports_give_the_cells_of_their_rounds_together():
    """``bench_pool.py`` over two reports computes each cell on both reports' rounds as one run of them all would."""
    bench, pool = bench_module(), tool_module("bench_pool")
    rng = random.Random(2)
    first, second = noisy_runs(bench, 6, rng), noisy_runs(bench, 4, rng)
    for runs in (first, second):
        runs[bench.twin_name(2)] = [bench.Tally(tokens=t.tokens * rng.uniform(0.9, 1.1), seconds=1.0)
                                    for t in runs["K=2"]]
    both = {n: first[n] + second[n] for n in first}
    versus, twins = pool.pooled_cells(pool.pooled_runs([report(bench, first), report(bench, second)]))
    rows = [{"batch": 4, "contender": n, "vs_no_spec": bench.per_round_ratio(both[n], both["no-spec"])} for n in both]
    assert versus == [{**bench.against_best(rows)[0], "held_out": pytest.approx(bench.against_held_out_best(both)),
                       "interval": pytest.approx(bench.interval_vs_best(both))}]
    assert versus[0]["ratio"] == pytest.approx(bench.against_best(rows)[0]["ratio"])
    assert twins[0]["vs_original"] == pytest.approx(bench.per_round_ratio(both["K=2 again"], both["K=2"]))
    with pytest.raises(ValueError, match="meta\\['length_spread'\\] is 0"):
        pool.pooled_runs([report(bench, first), report(bench, second, length_spread=0)])


def test_bench_prices_adaptive_ks_choices_at_the_fixed_runs_rates():
    """Adaptive K's mix of K priced at each K's fixed run of the same round (tokens and seconds per step), over the
    best's tokens/s, median of rounds: its choices without its own run's noise."""
    bench = bench_module()
    tally = lambda tokens, seconds, steps, per_k=None: bench.Tally(  # noqa: E731
        tokens=tokens, seconds=seconds, steps=steps, steps_per_k=per_k or {})
    fixed = {0: tally(100, 1.0, 100), 1: tally(180, 1.5, 100), 2: tally(240, 2.0, 100)}  # 100, 120, 120 tok/s
    mixed = tally(0, 1.0, 40, {1: 30, 0: 10})
    # 30 K = 1 steps (54 tokens in 0.45 s) and 10 plain ones (10 in 0.1 s): 64 / 0.55
    assert bench.priced_mix(mixed, fixed) == pytest.approx(64 / 0.55)
    assert bench.priced_mix(tally(0, 1.0, 5, {3: 5}), fixed) is None  # a K no fixed run measured
    slower = {k: tally(t.tokens, 2 * t.seconds, t.steps) for k, t in fixed.items()}  # a round at half speed
    rounds = [mixed, mixed, tally(0, 1.0, 10, {2: 10})]
    ratio = bench.choices_vs_best(rounds, {k: [fixed[k], slower[k], slower[k]] for k in fixed},
                                  [fixed[1], slower[1], slower[1]])
    assert ratio == pytest.approx(64 / 0.55 / 120)  # each round against its own best: 0.97, 0.97, 1.0


def test_bench_sums_up_the_cells_as_geometric_means():
    bench = bench_module()
    versus = [{"batch": 1, "best": "K=1", "ratio": 0.9}, {"batch": 8, "best": "no-spec", "ratio": 1.1}]
    twins = [{**v, "twin": "K=2 again", "vs_original": r} for v, r in zip(versus, (0.8, 1.25))]
    assert bench.summary_lines(versus, twins) == [
        "over batches 1, 8: adaptive 0.995x the best other contender (geometric mean)",
        "over batches 1, 8: K=2 again 0.995x the best, 1.000x itself (geometric means)"]
    assert bench.summary_lines(versus[:1], twins[:1]) == []
    priced = [{**v, "choices": c} for v, c in zip(versus, (0.81, 1.0))]
    assert bench.summary_lines(priced, [])[1] == (
        "over batches 1, 8: adaptive's choices, priced at the fixed runs' rates, 0.900x the best (geometric mean)")
    held_out = [{**v, "held_out": h} for v, h in zip(twins, (0.9, 0.9))]
    assert bench.summary_lines(held_out, held_out) == [
        "over batches 1, 8: adaptive 0.995x the best other contender (geometric mean)",
        "over batches 1, 8: adaptive 0.900x the best picked on the other rounds (geometric mean)",
        "over batches 1, 8: K=2 again 0.995x the best, 0.900x the best picked on the other rounds, 1.000x itself "
        "(geometric means)"]


def test_bench_names_the_cpu_beyond_torchs_capability():
    """Torch's capability reads AVX512 on a Xeon with AMX and on an AMD EPYC without: the bench's header names the
    CPU model (where the OS tells it), the capability, AMX tiles where present, and the threads."""
    import torch

    kind = bench_module().cpu_kind()
    assert f"({torch.backends.cpu.get_cpu_capability()}" in kind and kind.endswith(f"{torch.get_num_threads()} threads")
    assert (", AMX)" in kind) == amx_cpu()


def test_bench_twin_must_be_one_of_the_fixed_ks():
    proc = subprocess.run([sys.executable, str(TOOLS / "bench.py"), "--ks", "1", "2", "--twin", "3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--twin: one of --ks [1, 2] (got 3)" in proc.stderr


def test_bench_sets_each_round_against_no_specs_run_of_the_same_round():
    """The machine's speed drifts between rounds: a contender that ran 0.95x no-spec in every round but one, where
    it met a slow patch, is 0.95x, not a ratio of medians taken from different rounds."""
    bench = bench_module()
    tally = lambda rate: bench.Tally(tokens=int(rate), seconds=1.0)  # noqa: E731
    base = [tally(r) for r in (100, 300, 310)]
    runs = [tally(r) for r in (95, 105, 294.5)]
    assert bench.per_round_ratio(runs, base) == pytest.approx(0.95, abs=0.01)
    with pytest.raises(ValueError):
        bench.per_round_ratio(runs[:2], base)
