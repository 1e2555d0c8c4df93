#!/usr/bin/env python3
"""What Dynamo's guards cost a fused step: the engine's guard filter against Dynamo's defaults, side by side.

    python tools/bench_guards.py                    # batch 1 and 8, K = 0 and 3, context 128
    python tools/bench_guards.py --batches 1 2 8 16 --ks 0 1 3 --rounds 5

Three engines share one model and compile the same step graphs: ``default`` keeps every guard Dynamo writes (each
module, parameter, closure cell and global the trace touched), ``inputs`` keeps the guards on the call's
arguments and the global state only (``graph.backends.guards.keep_input_guards``), both dispatched by Dynamo;
``whole`` is what the CPU engine runs by default, graphs saved whole (``graph.backends.aot_graphs``: the portable
subset of ``inputs``' guards, checked by the loaded function before each call).
Each round times every (batch, K) step on both, alternating, on the same inert inputs (shapes, not data, set a
step's cost); the report gives medians over rounds of the per-round medians, and their ratio.
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch

from ascend_spec.config import EngineConfig, SpeculativeConfig, GraphModeConfig
from ascend_spec.engine import Engine
from ascend_spec.graph.backends.compile_cache import ENV_DISABLE
from ascend_spec.graph.weights import load_model
from ascend_spec.models import BUNDLED_MODEL_DIR


def engine(model, batches: list[int], k_max: int, guards: str) -> Engine:  # noqa: ANN001
    cfg = EngineConfig(max_model_len=512, max_num_seqs=max(batches),
                       speculative=SpeculativeConfig(num_speculative_tokens=k_max),
                       graph=GraphModeConfig(backend="inductor", graph_batch_sizes=tuple(batches)))
    # Dynamo's own dispatch where graphs are not stored whole (the store needs the compile cache)
    os.environ[ENV_DISABLE] = "0" if guards == "whole" else "1"
    eng = Engine(model, cfg, device="cpu")
    if guards == "default":
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
    engines = {name: engine(model, args.batches, k_max, name) for name in ("default", "inputs", "whole")}
    times: dict[tuple[int, int, str], list[float]] = {}
    for r in range(args.rounds):
        names = list(engines) if r % 2 == 0 else list(reversed(engines))
        for b in args.batches:
            for k in args.ks:
                for name in names:
                    t = engines[name].time_step(b, k, args.context, args.repeats)
                    times.setdefault((b, k, name), []).append(t)
    print("| batch | K | default guards (ms) | input guards (ms) | saved whole (ms) | input ÷ default | whole ÷ input |")
    print("|---|---|---|---|---|---|---|")
    for b in args.batches:
        for k in args.ks:
            d, i, w = (1e3 * statistics.median(times[(b, k, name)]) for name in ("default", "inputs", "whole"))
            print(f"| {b} | {k} | {d:.2f} | {i:.2f} | {w:.2f} | {i / d:.3f} | {w / i:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
