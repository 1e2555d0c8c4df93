#!/usr/bin/env python3
"""What Dynamo's guards cost a fused step: the engine's guard filter against Dynamo's defaults, side by side.

    python tools/bench_guards.py                    # batch 1 and 8, K = 0 and 3, context 128
    python tools/bench_guards.py --batches 1 2 8 16 --ks 0 1 3 --rounds 5

Two engines share one model and compile the same step graphs: ``default`` keeps every guard Dynamo writes (each
module, parameter, closure cell and global the trace touched), ``inputs`` keeps the guards on the call's
arguments and the global state only (``graph.backends.guards.keep_input_guards``, what the CPU backend uses).
Each round times every (batch, K) step on both, alternating, on the same inert inputs (shapes, not data, set a
step's cost); the report gives medians over rounds of the per-round medians, and their ratio.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from ascend_spec.config import EngineConfig, SpeculativeConfig, TorchairGraphConfig
from ascend_spec.engine import Engine
from ascend_spec.graph.weights import load_model
from ascend_spec.models import BUNDLED_MODEL_DIR


def engine(model, batches: list[int], k_max: int, filtered: bool) -> Engine:  # noqa: ANN001
    cfg = EngineConfig(max_model_len=512, max_num_seqs=max(batches),
                       speculative=SpeculativeConfig(num_speculative_tokens=k_max),
                       graph=TorchairGraphConfig(backend="inductor", graph_batch_sizes=tuple(batches)))
    eng = Engine(model, cfg, device="cpu")
    if not filtered:
        eng.backend.guard_filter = None  # Dynamo's default guards
    eng.warmup(progress=False)
    return eng


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 3])
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=40)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model = load_model(BUNDLED_MODEL_DIR, device="cpu")
    k_max = max(1, *args.ks)
    engines = {"default": engine(model, args.batches, k_max, False),
               "inputs": engine(model, args.batches, k_max, True)}
    times: dict[tuple[int, int, str], list[float]] = {}
    for r in range(args.rounds):
        names = list(engines) if r % 2 == 0 else list(reversed(engines))
        for b in args.batches:
            for k in args.ks:
                for name in names:
                    t = engines[name].time_step(b, k, args.context, args.repeats)
                    times.setdefault((b, k, name), []).append(t)
    print(f"| batch | K | default guards (ms) | input guards (ms) | saved (ms) | input ÷ default |")
    print("|---|---|---|---|---|---|")
    for b in args.batches:
        for k in args.ks:
            d = 1e3 * statistics.median(times[(b, k, "default")])
            i = 1e3 * statistics.median(times[(b, k, "inputs")])
            print(f"| {b} | {k} | {d:.2f} | {i:.2f} | {d - i:.2f} | {i / d:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
