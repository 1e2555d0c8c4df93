#!/usr/bin/env python3
"""The padded and the unpadded drafter batch (``disable_padded_drafter_batch``), side by side in one run.

    python tools/bench_unpadded.py [--k 2] [--prompts 2] [--max-tokens 48] [--rounds 7] [--step-by-step] [--threads 1]

Inductor, the 2-layer fixture, greedy, fixed K. A no-spec engine gives the reference tokens; the padded and the
unpadded engine take turns (the order alternating round to round) on the same requests, after one untimed run
each; timed runs count no host syncs (the counter's modes slow every op), a last run per contender does. Prints
per contender the median tokens/s over the rounds, the ratio unpadded / padded, the most recompiles after warm-up
of any run and the counted run's host syncs per step; exits non-zero if any contender's tokens differ from the
no-spec run's. One intra-op thread by default: on a CPU shared with other jobs, more threads than free cores
made a step 10x slower (threads spinning for each other).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from ascend_spec.config import EngineConfig, SpeculativeConfig, GraphModeConfig
from ascend_spec.engine import Engine, load_engine
from ascend_spec.models import FIXTURE_MODEL_DIR
from ascend_spec.sampling import SamplingParams
from ascend_spec.tokenizer import TextTokenizer

PROMPTS_FILE = Path(__file__).with_name("bench_prompts.txt")


def engine(k: int, padded: bool, fused: bool) -> Engine:
    spec = SpeculativeConfig(num_speculative_tokens=k, disable_padded_drafter_batch=not padded) if k else None
    return load_engine(FIXTURE_MODEL_DIR, EngineConfig(
        max_model_len=256, max_num_seqs=4, speculative=spec, adaptive_k=False, fused_step=fused,
        graph=GraphModeConfig(backend="inductor", graph_batch_sizes=(1, 2, 4))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--step-by-step", dest="fused", action="store_false",
                    help="the engines' step-by-step path (fused_step off) instead of the fused step")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = TextTokenizer(FIXTURE_MODEL_DIR)
    lines = [line for line in PROMPTS_FILE.read_text().splitlines() if line.strip()][: args.prompts]
    prompts = [tok.encode(line.replace("\\n", "\n")) for line in lines]
    params = SamplingParams()
    ref = [o.token_ids for o in engine(0, True, args.fused).generate(prompts, params, args.max_tokens)[0]]
    engines = {"padded": engine(args.k, True, args.fused), "unpadded": engine(args.k, False, args.fused)}
    for eng in engines.values():
        eng.generate(prompts, params, args.max_tokens)  # warm-up run (compiles, caches)
    tps: dict[str, list[float]] = {name: [] for name in engines}
    recompiles = dict.fromkeys(engines, 0)
    syncs = dict.fromkeys(engines, 0.0)
    same = dict.fromkeys(engines, True)
    for r in range(args.rounds + 1):
        for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            counted = engines[name].runner.count_host_syncs = r == args.rounds
            outs, stats, _ = engines[name].generate(prompts, params, args.max_tokens)
            if counted:
                syncs[name] = stats.host_syncs_per_step
            else:
                tps[name].append(stats.generated_tokens / stats.decode_seconds)
            recompiles[name] = max(recompiles[name], stats.recompiles_after_warmup)
            same[name] &= [o.token_ids for o in outs] == ref
    med = {name: statistics.median(t) for name, t in tps.items()}
    path = "fused step" if args.fused else "step by step"
    print(f"K={args.k}, {len(prompts)} prompts x {args.max_tokens} tokens, {path}, {args.rounds} rounds (medians)")
    for name in engines:
        print(f"{name:>9}: {med[name]:8.1f} tok/s  recompiles after warm-up {recompiles[name]}  "
              f"host syncs/step {syncs[name]:.2f}  tokens == no-spec: {same[name]}")
    print(f"unpadded / padded: {med['unpadded'] / med['padded']:.2f}")
    if not all(same.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
