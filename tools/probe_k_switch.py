#!/usr/bin/env python3
"""What a change of K costs on the device path: the same requests at a scripted K per step, side by side.

    python tools/probe_k_switch.py --device cuda [--batch 4] [--max-tokens 64] [--rounds 2]

One engine (inductor: CUDA graphs on CUDA, K = 0..2 compiled, adaptive K's graphs) serves every scenario; each
scripts the K of every step (``KPolicy.force_k``) so that only the pattern of K changes differs: K = 2 every step,
one K = 0 step in 40 (what adaptive K's explorations look like), and K alternating 2 / 0. Each runs twice: as the
engine steps today, and with ``torch.compiler.cudagraph_mark_step_begin()`` before every step (each step's graph a
new root of the CUDA graph tree, so replaying another K's graph never leaves a recorded path). Printed per
scenario: tokens/s, ms per step, and the CUDA graph tree's recordings and allocator checkpoints during the run
(counted by wrapping its manager's methods; 0 on CPU). A last run replays the K = 2 steps under
``torch.cuda.set_sync_debug_mode("error")`` around each step's graph call: a replay that synchronises raises.

``--after-change BLOCK`` asks instead what a step costs right after a change of K, on any device: blocks of BLOCK
steps at K = 0..K_max in turn, and per K its first, second and third step of a block over the median of the rest
of that block (adaptive K prices a K it explores on the second step of an exploration).
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections import Counter, defaultdict
from typing import Callable, Iterator

import torch

from ascend_spec.config import EngineConfig, SpeculativeConfig, GraphModeConfig
from ascend_spec.engine import Engine
from ascend_spec.graph.weights import load_model
from ascend_spec.models import FIXTURE_MODEL_DIR
from ascend_spec.sampling import SamplingParams
from ascend_spec.tokenizer import TextTokenizer

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n", "class Stack:\n    def __init__(self",
           "for i in range(10):\n", "    return", "raise ValueError(", "while True:\n", "with open(path) as f:\n"]
SCENARIOS: dict[str, Callable[[int], int]] = {
    "K=2": lambda i: 2,
    "K=0 every 40th": lambda i: 0 if i % 40 == 39 else 2,
    "alternate 2/0": lambda i: 2 if i % 2 == 0 else 0,
}
#: CUDA graph tree manager methods counted: a new recording, and restoring the pool to a recorded path's state
TREE_EVENTS = ("record_function", "apply_checkpoint_execution_state_in_allocator")


@contextlib.contextmanager
def tree_events() -> Iterator[Counter]:
    counts: Counter = Counter()
    try:
        from torch._inductor.cudagraph_trees import CUDAGraphTreeManager
    except ImportError:
        yield counts
        return
    saved = {name: getattr(CUDAGraphTreeManager, name) for name in TREE_EVENTS if hasattr(CUDAGraphTreeManager, name)}

    def counting(name: str, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    for name, fn in saved.items():
        setattr(CUDAGraphTreeManager, name, counting(name, fn))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(CUDAGraphTreeManager, name, fn)


def run(eng: Engine, prompts: list[list[int]], max_tokens: int, k_of_step: Callable[[int], int],
        mark_step: bool) -> tuple[float, float, int, Counter]:
    policy, count = eng.k_policy, [0]
    plan = policy.plan
    mark = mark_step and eng.device.type == "cuda"

    def scripted(running, warm):  # the scheduler asks the step's K before it makes room for it
        policy.force_k = k_of_step(count[0])
        count[0] += 1
        if mark:
            torch.compiler.cudagraph_mark_step_begin()
        return plan(running, warm)

    policy.plan = scripted
    try:
        with tree_events() as events:
            t0 = time.perf_counter()
            out, stats, _ = eng.generate(prompts, SamplingParams(), max_tokens)
            seconds = time.perf_counter() - t0
    finally:
        del policy.plan
        policy.force_k = None
    tokens = sum(len(o.token_ids) for o in out)
    return tokens / seconds, 1000 * seconds / max(stats.num_steps, 1), stats.num_steps, events


def runs_of_k(steps: list[tuple[int, float, bool]]) -> list[tuple[int, list[float]]]:
    """``(k, seconds, switched)`` per step → each run of steps at one K, from a change of K to the next."""
    runs: list[tuple[int, list[float]]] = []
    for k, seconds, switched in steps:
        if switched or not runs or runs[-1][0] != k:
            runs.append((k, []))
        runs[-1][1].append(seconds)
    return runs


def after_change(eng: Engine, prompts: list[list[int]], max_tokens: int, block: int,
                 rounds: int) -> dict[int, dict[str, float]]:
    """Per K: the median over blocks of its first, second and third step's time over the median of the rest of
    its block (blocks of ``block`` steps at K = 0..K_max in turn)."""
    ks = list(range(eng.k_max + 1))
    policy = eng.runner.k_policy
    ratios: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for _ in range(rounds):
        steps: list[tuple[int, float, bool]] = []
        policy.observe = lambda bucket, k, seconds, between, switched=False: steps.append((k, seconds, switched))
        try:
            run(eng, prompts, max_tokens, lambda i: ks[(i // block) % len(ks)], mark_step=False)
        finally:
            del policy.observe
        for k, times in runs_of_k(steps):
            if len(times) > 4:
                rest = statistics.median(times[3:])
                for name, t in zip(("first", "second", "third"), times):
                    ratios[k][name].append(t / rest)
    return {k: {name: statistics.median(v) for name, v in r.items()} | {"blocks": len(r["first"])}
            for k, r in sorted(ratios.items())}


class SyncChecked:
    """The runner's step graphs, each call under ``set_sync_debug_mode("error")``."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __call__(self, *args):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return self.inner(*args)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default=str(FIXTURE_MODEL_DIR))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--k-max", type=int, default=2)
    ap.add_argument("--after-change", type=int, default=None, metavar="BLOCK",
                    help="time the steps after each change of K instead (blocks of BLOCK >= 6 steps per K)")
    args = ap.parse_args()
    if args.after_change is not None and args.after_change < 6:
        ap.error(f"--after-change: blocks of at least 6 steps (got {args.after_change})")
    model = load_model(args.model, device=args.device)
    tok = TextTokenizer(args.model)
    prompts = [tok.encode(p) for p in (PROMPTS * 4)[: 2 * args.batch]]
    cfg = EngineConfig(max_model_len=256, max_num_seqs=args.batch,
                       speculative=SpeculativeConfig(num_speculative_tokens=args.k_max),
                       graph=GraphModeConfig(backend="inductor", graph_batch_sizes=(args.batch,)), adaptive_k=True)
    eng = Engine(model, cfg, device=args.device)
    eng.eos_token_id = None
    t0 = time.perf_counter()
    eng.warmup(progress=False)
    print(f"{torch.cuda.get_device_name() if eng.device.type == 'cuda' else 'cpu'}, torch {torch.__version__}, "
          f"batch {args.batch}, {len(prompts)} requests x {args.max_tokens} tokens; warm-up {time.perf_counter() - t0:.0f} s",
          flush=True)
    if args.after_change is not None:
        print("| K | first | second | third | blocks |\n|---|---|---|---|---|")
        for k, r in after_change(eng, prompts, args.max_tokens, args.after_change, args.rounds).items():
            print(f"| {k} | {r['first']:.3f} | {r['second']:.3f} | {r['third']:.3f} | {r['blocks']} |", flush=True)
        return
    results: dict[tuple[str, bool], list[tuple]] = {}
    for r in range(args.rounds):
        for name, k_of_step in SCENARIOS.items():
            for mark in (False, True):
                results.setdefault((name, mark), []).append(run(eng, prompts, args.max_tokens, k_of_step, mark))
    print("| scenario | mark_step_begin | tok/s | ms/step | steps | recordings | checkpoints |")
    print("|---|---|---|---|---|---|---|")
    for (name, mark), rows in results.items():
        tps = statistics.median(x[0] for x in rows)
        ms = statistics.median(x[1] for x in rows)
        rec = [x[3].get(TREE_EVENTS[0], 0) for x in rows]
        ckp = [x[3].get(TREE_EVENTS[1], 0) for x in rows]
        print(f"| {name} | {mark} | {tps:.1f} | {ms:.2f} | {rows[-1][2]} | {rec} | {ckp} |", flush=True)
    if eng.device.type == "cuda":
        eng.runner.spec_graphs = SyncChecked(eng.runner.spec_graphs)
        try:
            run(eng, prompts, args.max_tokens, SCENARIOS["K=2"], mark_step=True)
            print("sync debug mode 'error' around every step graph: no synchronisation")
        except RuntimeError as exc:
            print(f"sync debug mode 'error': {type(exc).__name__}: {str(exc)[:300]}")
        finally:
            eng.runner.spec_graphs = eng.runner.spec_graphs.inner


if __name__ == "__main__":
    main()
