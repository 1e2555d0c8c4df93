#!/usr/bin/env python3
"""Does the default (adaptive K) lose to a fixed setting, on a start with an earlier run's learnings and on a cold one?

    python tools/bench_default_k.py [--batches 1 8] [--k-max 3] [--rounds N] [--workloads short long]

One engine (inductor, the bundled model, greedy) serves every contender, so they replay the same compiled graphs:
no-spec (K = 0), fixed K for each K in 1..K_max, and the default, adaptive K, twice: ``default (learned)``, each run
started as an engine started now with the learnings an earlier run of the same requests kept (acceptance, step
costs: ``ascend_spec.learnings``, through a store of this bench's own), and ``default (cold)``, each run started
with nothing learned (step costs from warm-up alone). Every run of the default starts from that state afresh, so
each one is a first run after a start. A workload is a run of ``n`` requests of ``t`` tokens each (``short``:
8 x 128, what a short run spends learning shows there; ``long``: 32 x 256), at most ``b`` running at once
(continuous batching). Contenders take turns on each workload, in an order rotating from round to round
(``tools/bench.py``'s ``turn_order``); figures are medians over rounds, and the default's ratio to the best other
contender is the median of each round's ratio to that contender's run of the round. Goal: default >= 0.97x the best
of no-spec and every fixed K at every batch size. The user's own cache of learnings is neither read nor written.
Prints a Markdown table; ``--out`` writes it and the runs as JSON too.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import (ADAPTIVE_GOAL, MAX_MODEL_LEN, PROMPTS_FILE, Tally, cpu_kind, read_prompts, serve,  # noqa: E402
                   turn_order)

from ascend_spec.adaptive import AdaptiveK  # noqa: E402
from ascend_spec.config import EngineConfig, GraphModeConfig, SpeculativeConfig  # noqa: E402
from ascend_spec.engine import LEARNINGS_FLAVOUR, Engine  # noqa: E402
from ascend_spec.graph.backends.compile_cache import CompileCache  # noqa: E402
from ascend_spec.graph.weights import load_model  # noqa: E402
from ascend_spec.learnings import Learnings, LearningsStore, learnings_key  # noqa: E402
from ascend_spec.models import BUNDLED_MODEL_DIR  # noqa: E402
from ascend_spec.tokenizer import TextTokenizer  # noqa: E402

#: name -> (requests, tokens each)
WORKLOADS = {"short": (8, 128), "long": (32, 256)}
LEARNED, COLD = "default (learned)", "default (cold)"


class Starts:
    """Puts the engine's K policy in the state an engine started now would have: nothing learned (warm-up's step
    costs), or seeded from the learnings an earlier run kept (saved to and loaded from a store of the bench's own,
    as the engine saves and loads them)."""

    def __init__(self, eng: Engine, root: Path) -> None:
        self.eng = eng
        self.warm = copy.deepcopy(eng.k_policy.step_seconds)
        self.pending = set(eng.k_policy.costs.pending)
        self.store = LearningsStore(CompileCache(root))
        self.key = learnings_key(eng.model.cfg.to_hf_dict(), eng.model, k_max=eng.k_max, dtype=eng.dtype,
                                 backend=eng.backend_name, batch_sizes=eng.k_policy.batch_sizes,
                                 flavour=f"bench-{LEARNINGS_FLAVOUR}", device=eng.device)

    def cold(self) -> None:
        policy = self.eng.k_policy
        policy.restart()
        fresh = AdaptiveK(self.eng.k_max, step_seconds=copy.deepcopy(self.warm), pending=set(self.pending))
        for f in dataclasses.fields(AdaptiveK):  # in place: warm-up holds this object (a deferred K's timing)
            setattr(policy.costs, f.name, getattr(fresh, f.name))

    def learned(self) -> bool:
        """Seed from the saved learnings (after :meth:`cold`); False when none are saved."""
        self.cold()
        saved = self.store.load(self.key)
        if saved is None:
            return False
        saved.seed(self.eng.k_policy)
        return True

    def keep(self) -> None:
        """Save what the policy learned, as the engine does at the end of a run."""
        self.store.save(self.key, Learnings.from_policy(self.eng.k_policy))


def run_default(eng: Engine, starts: Starts, learned: bool, requests: list[list[int]], batch: int,
                tokens: int, tally: Tally) -> None:
    if not learned:
        starts.cold()
    elif not starts.learned():
        raise RuntimeError("no learnings saved: the earlier run did not keep any")
    serve(eng, requests, batch, [tokens] * len(requests), None, tally)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=BUNDLED_MODEL_DIR)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--k-max", type=int, default=3)
    ap.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=list(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=None,
                    help="rounds per workload and batch (default: one per contender, each in every place once)")
    ap.add_argument("--out", type=Path, default=None, help="a folder for results.md and results.json")
    args = ap.parse_args()
    if args.k_max < 1:
        ap.error(f"--k-max: an int >= 1 (got {args.k_max})")
    if args.rounds is not None and args.rounds < 1:
        ap.error(f"--rounds: at least 1 (got {args.rounds})")
    torch.manual_seed(0)
    model = load_model(args.model)
    prompts = read_prompts(PROMPTS_FILE, TextTokenizer(args.model))
    cfg = EngineConfig(max_model_len=MAX_MODEL_LEN, max_num_seqs=max(args.batches),
                       speculative=SpeculativeConfig(num_speculative_tokens=args.k_max),
                       graph=GraphModeConfig(backend="inductor", graph_batch_sizes=tuple(sorted(args.batches))),
                       adaptive_k=True, keep_learnings=False)  # learnings: the bench's own store (``Starts``)
    eng = Engine(model, cfg)
    eng.eos_token_id = None  # every request generates its budget: the same work for every contender
    t0 = time.perf_counter()
    eng.warmup(progress=True)
    print(f"warm-up {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    contenders: dict[str, int | None] = {"no-spec": 0, **{f"K={k}": k for k in range(1, args.k_max + 1)},
                                         LEARNED: None, COLD: None}
    rounds = args.rounds or len(contenders)
    cells = [(w, b) for w in args.workloads for b in args.batches]
    with tempfile.TemporaryDirectory(prefix="bench-learnings-") as root:
        starts = Starts(eng, Path(root))
        runs: dict[tuple[str, int, str], list[Tally]] = {}
        for w, b in cells:  # the earlier run whose learnings the learned default starts from
            n, tokens = WORKLOADS[w]
            requests = [prompts[i % len(prompts)] for i in range(n)]
            run_default(eng, starts, False, requests, b, tokens, Tally())
            starts.keep()
            for r in range(rounds):
                for name in turn_order(list(contenders), r):
                    tally = Tally()
                    if contenders[name] is None:
                        run_default(eng, starts, name == LEARNED, requests, b, tokens, tally)
                    else:
                        serve(eng, requests, b, [tokens] * n, contenders[name], tally)
                    runs.setdefault((w, b, name), []).append(tally)
                    print(f"{w} batch {b} round {r} {name}: {tally.tokens_per_s:.1f} tok/s "
                          f"K steps {dict(sorted(tally.steps_per_k.items()))}", file=sys.stderr, flush=True)
    lines, rows = table(runs, cells, list(contenders), rounds)
    head = (f"{cpu_kind()}; torch {torch.__version__}; {args.model.name}, greedy, inductor, K_max {args.k_max}; "
            f"medians of {rounds} round(s), contenders interleaved")
    print("\n".join([head, "", *lines]))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.md").write_text("\n".join([head, "", *lines]) + "\n")
        (args.out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")


def table(runs: dict[tuple[str, int, str], list[Tally]], cells: list[tuple[str, int]], names: list[str],
          rounds: int) -> tuple[list[str], list[dict]]:
    """The Markdown table (tok/s per contender; the default's ratio to the best other, per round then the median)
    and its rows."""
    fixed = [n for n in names if n not in (LEARNED, COLD)]
    lines = ["| workload | batch | " + " | ".join(names) + " | best other | learned ÷ best | cold ÷ best |",
             "|---|---|" + "---|" * (len(names) + 3)]
    rows = []
    for w, b in cells:
        rate = {n: statistics.median(t.tokens_per_s for t in runs[(w, b, n)]) for n in names}
        best = max(fixed, key=rate.__getitem__)
        ratio = {n: statistics.median(runs[(w, b, n)][r].tokens_per_s / runs[(w, b, best)][r].tokens_per_s
                                      for r in range(rounds)) for n in (LEARNED, COLD)}
        mark = {n: "" if ratio[n] >= ADAPTIVE_GOAL else " ✗" for n in ratio}
        n_req, tokens = WORKLOADS[w]
        lines.append(f"| {w} ({n_req} x {tokens}) | {b} | " + " | ".join(f"{rate[n]:.1f}" for n in names)
                     + f" | {best} | {ratio[LEARNED]:.3f}{mark[LEARNED]} | {ratio[COLD]:.3f}{mark[COLD]} |")
        rows.append({"workload": w, "batch": b, "tokens_per_s": rate, "best": best, "learned_vs_best": ratio[LEARNED],
                     "cold_vs_best": ratio[COLD],
                     "steps_per_k": {n: runs[(w, b, n)][-1].steps_per_k for n in (LEARNED, COLD)},
                     "tokens_per_s_per_round": {n: [t.tokens_per_s for t in runs[(w, b, n)]] for n in names}})
    lines += ["", "tok/s: medians over rounds; ÷ best: the median of each round's ratio to the best other "
              f"contender's run (no-spec or a fixed K; ✗: under the goal {ADAPTIVE_GOAL})."]
    return lines, rows


if __name__ == "__main__":
    main()
