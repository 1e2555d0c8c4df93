#!/usr/bin/env python3
"""Does MTP pay inside vLLM as users run it? Ours with the measured K per batch size against no speculation and
vLLM's drafter at each fixed K, 0 included (a hand-written schedule at one batch size is one K), in vLLM's CPU
engine with its compile on.

    python tools/bench_vllm_schedule.py                 # batch 1 and 8, K_max 3, 2 rounds
    python tools/bench_vllm_schedule.py --batches 8 --rounds 3 --json out.json
    python tools/bench_vllm_schedule.py --checkpoint fixture   # the 2-layer test fixture: overheads weigh 5x more

Every engine runs in a harness process of its own, as a server runs it; the contenders of a batch size take turns
in an order that rotates from round to round. Each engine generates ``--repeat`` times; the first
``--warmup-calls`` calls are not timed (our schedule sweeps and learns there, as it does in a server's first
minutes; the learnings it saves in the compile cache at shutdown start the next engine of ours, as a restarted
server finds them). Prints tokens/s (medians over rounds of each engine's median call) and ours ÷ no-spec, ours ÷
the best of vLLM's drafter.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ascend_spec_tools.vllm_harness import BUNDLED_CHECKPOINT, CHECKPOINT, PROMPTS  # noqa: E402  no vLLM import


def contenders(batch: int, k_max: int, vllm_ks: list[int], max_tokens: int, repeat: int) -> list[dict]:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(max(batch, 2))]
    common = {"prompts": prompts, "max_tokens": max_tokens, "repeat": repeat,
              "llm": {"max_num_seqs": batch, "enforce_eager": False}}
    runs = [{"name": f"b{batch}_none", "drafter": "none", **common},
            {"name": f"b{batch}_ours_auto", "drafter": "ours", "k": k_max, "ascend": {"k_schedule": "auto"},
             **common}]
    # K = 0 for vLLM's drafter is a schedule the user wrote: vLLM then runs its MTP layer for the cache only
    runs += [{"name": f"b{batch}_vllm_k{k}", "drafter": "vllm", "k": k or 1, **common,
              **({"spec": {"num_speculative_tokens_per_batch_size": [[1, batch, 0]]}} if k == 0 else {})}
             for k in vllm_ks]
    return runs


def serve_alone(cfg: dict, checkpoint: str, progress: str) -> dict:
    """One engine in a process of its own, as a server runs it. Engines started one after another in one process
    share its OpenMP threads and what vLLM sets for the whole process (its CPU worker replaces
    ``torch.set_num_threads`` for the rest of it): a contender's figure could depend on who ran before it."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg_file, out = Path(tmp) / "configs.json", Path(tmp) / "results.json"
        cfg_file.write_text(json.dumps([cfg]))
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        print(f"{progress} {cfg['name']}", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "ascend_spec_tools.vllm_harness", str(cfg_file), "--out", str(out),
                        "--checkpoint", checkpoint], cwd=REPO, env=env, check=True)
        return json.loads(out.read_text())[0]


def timed(result: dict, warmup_calls: int) -> float:
    """tokens/s of the engine: the median of its calls after the warm-up ones."""
    if "error" in result:
        raise SystemExit(f"{result['name']}: {result['error']}")
    return statistics.median(result["tokens_per_s"][warmup_calls:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8", help="comma list of batch sizes (max_num_seqs, and prompts)")
    ap.add_argument("--k-max", type=int, default=3, help="num_speculative_tokens of ours (its schedule's K_max)")
    ap.add_argument("--vllm-ks", default="0,1,2,3", help="vLLM's drafter at each of these fixed K ('' for none)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5, help="generate calls per engine")
    ap.add_argument("--warmup-calls", type=int, default=2, help="untimed first calls of each engine")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--checkpoint", default="bundled",
                    help="bundled (12 + 1 layers, the model users try first) | fixture (2 + 1) | a folder")
    ap.add_argument("--json", type=Path, default=None, help="write the raw results here")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    vllm_ks = [int(k) for k in args.vllm_ks.split(",") if k.strip()]
    configs = []
    for r in range(args.rounds):
        for batch in batches:
            runs = contenders(batch, args.k_max, vllm_ks, args.max_tokens, args.repeat)
            shift = r % len(runs)
            configs += [{**c, "name": f"{c['name']}#{r}"} for c in runs[shift:] + runs[:shift]]
    checkpoint = {"bundled": BUNDLED_CHECKPOINT, "fixture": CHECKPOINT}.get(args.checkpoint, args.checkpoint)
    results = [serve_alone(cfg, checkpoint, f"[{i + 1}/{len(configs)}]") for i, cfg in enumerate(configs)]
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    by_name: dict[str, list[float]] = {}
    by_round: dict[tuple[str, str], float] = {}
    schedules: dict[str, list] = {}
    for res in results:
        name, round_ = res["name"].split("#")
        by_name.setdefault(name, []).append(timed(res, args.warmup_calls))
        by_round[(name, round_)] = by_name[name][-1]
        if res.get("schedule"):
            schedules.setdefault(name, []).append(res["schedule"][0]["steps"])
    print(f"\n{args.checkpoint}: tokens/s, medians of {args.rounds} rounds (calls after the first "
          f"{args.warmup_calls} of each engine)\n")
    print("| batch | no-spec | " + "".join(f"vLLM K={k} | " for k in vllm_ks)
          + "ours (auto) | ours ÷ no-spec | ours ÷ best vLLM | ours ÷ best of all |")
    print("|---" * (6 + len(vllm_ks)) + "|")
    for batch in batches:
        med = {n: statistics.median(v) for n, v in by_name.items() if n.startswith(f"b{batch}_")}
        none, ours = med[f"b{batch}_none"], med[f"b{batch}_ours_auto"]
        theirs = [med[f"b{batch}_vllm_k{k}"] for k in vllm_ks]
        best = max(theirs, default=0.0)
        print(f"| {batch} | {none:.0f} | " + "".join(f"{t:.0f} | " for t in theirs)
              + f"{ours:.0f} | {ours / none:.2f}× | " + (f"{ours / best:.2f}×" if best else "—")
              + f" | {ours / max(best, none):.2f}× |")
    for batch in batches:
        # each round's contenders ran minutes apart at most: the paired ratio shows the host's drift less
        paired = [by_round[(f"b{batch}_ours_auto", r)] / by_round[(f"b{batch}_none", r)]
                  for r in map(str, range(args.rounds))]
        print(f"batch {batch}, ours ÷ no-spec per round: {', '.join(f'{x:.3f}' for x in paired)}; "
              f"median {statistics.median(paired):.3f}")
    for name, steps in schedules.items():
        print(f"{name}: steps per bucket:K {steps[-1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
