#!/usr/bin/env python3
"""MoE layer latency, eager vs torch.compile, side by side (medians of interleaved repeats).

Times ``MoE.forward`` (gate + grouped top-k routing + routed experts + shared expert) on ``x [T, D]`` for each
number of routed experts E, top-k and token count T, for the routed formulation(s) asked for:

- ``--strategy auto`` (default): what the model runs (``graph.moe.pick_strategy``: compiled, gather when
  ``T·k <= 8E``; eager, gather when ``4·T·k <= E``; else dense);
- ``--strategy gather`` / ``dense``: pin one formulation;
- ``--strategy all``: both formulations, one row each, plus a summary table with one column per strategy and
  the winner per shape, to see where the ``auto`` switch-over should be.

Compiled callables: ONE ``torch.compile(moe, fullgraph=True, dynamic=False)`` per (E, top-k, strategy). With
``dynamic=False`` it specialises on the input shape, so every token count gets its own graph (a recompile on
the first call with that T); all of a row's graphs are built and warmed before that row is timed, and the
first-call seconds (Dynamo trace + Inductor compile) are reported per row in ``compile s``. Dynamo's
recompile limit is raised so no shape falls back to eager, and ``fail_on_recompile_limit_hit`` makes sure.

Each row first checks compiled output against eager on the same input (``max|diff|``; the run fails if it
exceeds ``--atol``, 1e-4 in fp32), so no wrong graph is ever timed. Then eager and compiled (and, with
``all``, both strategies) are timed round-robin: in each repeat every contender runs once.

    python tools/bench_moe.py [--experts 16 64] [--topk 2 8] [--tokens 1 2 4 8 16 32 64] [--hidden 1024]
                              [--moe-intermediate 256] [--n-group 1] [--dtype float32|bfloat16]
                              [--repeats 20] [--strategy auto|gather|dense|all] [--threads 2]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from ascend_spec.graph.config import MoEConfig
from ascend_spec.graph.moe import MoE, pick_strategy

from timing import interleaved_medians  # this folder is on sys.path

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_ATOL = {"float32": 1e-4, "bfloat16": 1e-2}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, nargs="+", default=[16, 64], help="routed experts E")
    p.add_argument("--topk", type=int, nargs="+", default=[2, 8], help="experts per token k")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64], help="token counts T")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--moe-intermediate", type=int, default=256, help="per-expert (and shared) intermediate size")
    p.add_argument("--n-group", type=int, default=1, help="expert groups; topk_group = n_group")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--strategy", choices=["auto", "gather", "dense", "all"], default="auto")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--atol", type=float, default=None, help="max |compiled - eager| (default 1e-4 fp32, 1e-2 bf16)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def build_moe(hidden: int, cfg: MoEConfig, dtype: torch.dtype, seed: int) -> MoE:
    """Random weights N(0, 0.02) from a seeded generator (the gate bias too; it stays fp32 as in the model)."""
    gen = torch.Generator().manual_seed(seed)
    moe = MoE(hidden, cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return moe.to(dtype).eval()


def share_weights(base: MoE, hidden: int, cfg: MoEConfig, strategy: str) -> MoE:
    """Another MoE module over the same weight tensors (no copy) with its routed strategy pinned."""
    with torch.device("meta"):
        moe = MoE(hidden, cfg)
    moe.load_state_dict(base.state_dict(), assign=True)
    moe.strategy = strategy  # type: ignore[assignment]
    return moe.eval()


def configure_dynamo(limit: int) -> None:
    cfg = torch._dynamo.config
    # 2.13 calls it recompile_limit (cache_size_limit is the old alias); every (module, T) is one cache entry
    # of the single MoE.forward code object, so the default 8 would silently send later shapes to eager.
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, limit)
    for name in ("accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), limit))
    for name in ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit"):
        if hasattr(cfg, name):
            setattr(cfg, name, True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    atol = args.atol if args.atol is not None else DEFAULT_ATOL[args.dtype]
    strategies = ["gather", "dense"] if args.strategy == "all" else [args.strategy]
    combos = [(e, k) for e in args.experts for k in args.topk if k <= e]
    configure_dynamo(4 * len(combos) * len(strategies) * len(args.tokens) + 16)

    wall0 = time.perf_counter()
    print("# MoE layer: eager vs torch.compile (CPU)\n")
    print(f"- torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"inductor fx_graph_cache={torch._inductor.config.fx_graph_cache}, "
          f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    print(f"- hidden {args.hidden}, moe_intermediate {args.moe_intermediate}, shared experts 1 "
          f"(intermediate {args.moe_intermediate}), n_group = topk_group = {args.n_group}, dtype {args.dtype}")
    print(f"- E {args.experts}, top-k {args.topk}, tokens {args.tokens}, strategy {args.strategy}, "
          f"repeats {args.repeats} (interleaved, medians), seed {args.seed}, atol {atol:g}")
    print("- compiled: ONE torch.compile(moe, fullgraph=True, dynamic=False) per (E, top-k, strategy); it "
          "specialises per T (one graph per token count, built and warmed before timing); "
          "`compile s` = first call at that T (Dynamo + Inductor, may hit Inductor's on-disk cache)")
    print("- auto (eager→compiled pick): gather if 4·T·k <= E (eager) / T·k <= 8E (compiled), else dense\n")
    print("| E | top-k | tokens | strategy | eager ms | compiled ms | speed-up | max\\|diff\\| | compile s |")
    print("|---|---|---|---|---|---|---|---|---|")
    sys.stdout.flush()

    summary: list[tuple] = []
    failures: list[str] = []
    compile_total = 0.0
    with torch.inference_mode():
        for e, k in combos:
            cfg = MoEConfig(n_routed_experts=e, num_experts_per_tok=k, moe_intermediate_size=args.moe_intermediate,
                            n_group=args.n_group, topk_group=args.n_group)
            base = build_moe(args.hidden, cfg, dtype, args.seed)
            eager = {s: share_weights(base, args.hidden, cfg, s) for s in strategies}
            compiled = {s: torch.compile(eager[s], fullgraph=True, dynamic=False) for s in strategies}
            gen = torch.Generator().manual_seed(args.seed + 1)
            for t in args.tokens:
                x = torch.randn(t, args.hidden, generator=gen).to(dtype)
                compile_s, diffs = {}, {}
                for s in strategies:
                    start = time.perf_counter()
                    y_c = compiled[s](x)
                    compile_s[s] = time.perf_counter() - start
                    compile_total += compile_s[s]
                    y_e = eager[s](x)
                    diffs[s] = (y_c.float() - y_e.float()).abs().max().item()
                    if not diffs[s] < atol:  # also catches NaN
                        failures.append(f"E={e} k={k} T={t} {s}: max|diff| {diffs[s]:.3g} >= {atol:g}")
                    for _ in range(2):  # warm-up both
                        compiled[s](x)
                        eager[s](x)
                fns = {}
                for s in strategies:
                    fns[("eager", s)] = lambda m=eager[s]: m(x)
                    fns[("compiled", s)] = lambda m=compiled[s]: m(x)
                med = interleaved_medians(fns, args.repeats)
                picked = pick_strategy(t, k, e, compiled=True)
                picked_eager = pick_strategy(t, k, e, compiled=False)
                for s in strategies:
                    te, tc = med[("eager", s)], med[("compiled", s)]
                    label = f"auto→{picked_eager}/{picked}" if s == "auto" else s
                    print(f"| {e} | {k} | {t} | {label} | {te * 1e3:.3f} | {tc * 1e3:.3f} | {te / tc:.2f}x "
                          f"| {diffs[s]:.2e} | {compile_s[s]:.1f} |")
                sys.stdout.flush()
                summary.append((e, k, t, picked, med))

    if args.strategy == "all":
        print("\n## gather vs dense (ms; `winner` per mode, `auto` = the compiled pick, T·k <= 8E)\n")
        print("| E | top-k | tokens | T·k | auto | eager gather | eager dense | eager winner "
              "| compiled gather | compiled dense | compiled winner | auto right? |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for e, k, t, picked, med in summary:
            eg, ed = med[("eager", "gather")], med[("eager", "dense")]
            cg, cd = med[("compiled", "gather")], med[("compiled", "dense")]
            ew = "gather" if eg <= ed else "dense"
            cw = "gather" if cg <= cd else "dense"
            cost = (cg if picked == "gather" else cd) / min(cg, cd)
            ok = "yes" if picked == cw else f"no ({cost:.2f}x slower)"
            print(f"| {e} | {k} | {t} | {t * k} | {picked} | {eg * 1e3:.3f} | {ed * 1e3:.3f} | {ew} "
                  f"| {cg * 1e3:.3f} | {cd * 1e3:.3f} | {cw} | {ok} |")

    print(f"\ncompile (first calls) {compile_total:.1f} s; total wall {time.perf_counter() - wall0:.1f} s; "
          f"load average now {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    if failures:
        print("\nFAILED: compiled output differs from eager:\n" + "\n".join(f"- {f}" for f in failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
