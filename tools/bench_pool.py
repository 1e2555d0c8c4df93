#!/usr/bin/env python3
"""Adaptive K against the best other contender over the rounds of several bench runs of the same code.

    python tools/bench_pool.py RUN.json [RUN.json ...]

Each ``RUN.json`` is a ``tools/bench.py`` report (``results.json``) of the same command (batches, contenders,
lengths, machine kind). Its rounds are pooled, each still set against no-spec's run of the same round, and the
cells are computed as the bench computes them: adaptive ÷ best, its interval, ÷ the best picked on the other rounds,
and a twin's. A cell's figure from six rounds moves by about as much as the goal allows on a noisy machine; rounds
pooled over runs narrow it without one long run.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import bench

#: what the pooled runs must share: they measured the same thing
SAME = ("model", "dtype", "machine", "device", "max_tokens", "length_spread", "twin")


def pooled_runs(reports: list[dict]) -> dict[int, dict[str, list[bench.Tally]]]:
    """Per batch and contender, every report's rounds in order, as tallies of their tokens/s."""
    first = reports[0]
    for i, report in enumerate(reports[1:], 1):
        for key in SAME:
            if report["meta"].get(key) != first["meta"].get(key):
                raise ValueError(f"report {i}: meta[{key!r}] is {report['meta'].get(key)!r}, report 0 has "
                                 f"{first['meta'].get(key)!r}: pool only runs of one command on one kind of machine")
        cells = {(r["batch"], r["contender"]) for r in report["end_to_end"]}
        expected = {(r["batch"], r["contender"]) for r in first["end_to_end"]}
        if cells != expected:
            raise ValueError(f"report {i}: cells {sorted(cells ^ expected)} are not in both: pool runs of the same "
                             "--batches and --ks")
    runs: dict[int, dict[str, list[bench.Tally]]] = {}
    for report in reports:
        for row in report["end_to_end"]:
            runs.setdefault(row["batch"], {}).setdefault(row["contender"], []).extend(
                bench.Tally(tokens=rate, seconds=1.0) for rate in row["tokens_per_s_per_round"])
    return runs


def pooled_cells(runs: dict[int, dict[str, list[bench.Tally]]]) -> tuple[list[dict], list[dict]]:
    """Adaptive K's cells and a twin's (empty without one), as ``tools/bench.py`` reports them."""
    rows = [{"batch": b, "contender": name, "vs_no_spec": bench.per_round_ratio(ts, per_name["no-spec"])}
            for b, per_name in sorted(runs.items()) for name, ts in per_name.items()]
    twin = next((n for n in runs[min(runs)] if n.endswith(bench.TWIN_SUFFIX)), None)
    return bench.cells_vs_best(rows, runs, twin)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", type=Path, nargs="+", help="results.json of tools/bench.py runs")
    args = ap.parse_args()
    reports = [json.loads(path.read_text()) for path in args.reports]
    runs = pooled_runs(reports)
    versus, twins = pooled_cells(runs)
    rounds = len(next(iter(runs.values()))["no-spec"])
    print(f"{rounds} rounds of {len(reports)} runs ({reports[0]['meta']['machine']})\n")
    print(f"| batch | best other | adaptive ÷ best | {bench.INTERVAL_LEVEL:.0%} interval | ÷ best picked on the other "
          "rounds |" + (f" {twins[0]['twin']} ÷ best | its interval |" if twins else ""))
    print("|---|---|---|---|---|" + ("---|---|" if twins else ""))
    for v in versus:
        t = next((t for t in twins if t["batch"] == v["batch"]), None)
        extra = f" {t['ratio']:.2f} | {bench.fmt_interval(t['interval'])} |" if t else ""
        print(f"| {v['batch']} | {v['best']} | {v['ratio']:.2f} | {bench.fmt_interval(v['interval'])} | "
              f"{bench.fmt(v['held_out'])} |" + extra)
    print()
    for line in bench.summary_lines(versus, twins):
        print(line)


if __name__ == "__main__":
    main()
