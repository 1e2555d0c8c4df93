#!/usr/bin/env python3
"""Does speculation pay? Side-by-side on the bundled model, contenders interleaved in one run, medians.

1. Step costs per bucket (compiled): one target step (1 token) vs one MTP draft step (1 token), and the
   pieces of a K-step: target verify of 1+K tokens, the K-step draft chain, rejection sampling + bookkeeping.
2. End-to-end greedy tokens/s for K = 0 (no speculation), 1..K_max and adaptive K, at each batch size,
   with the fused one-graph step; speed-up over K = 0, mean tokens per request-step, speculation efficiency
   (speed-up ÷ mean tokens per step) and host µs per step.
3. Writes ``results.md``, ``results.json`` and PNG plots (tokens/s vs batch, acceptance per position, step-time
   breakdown) into ``--out``.

    python tools/bench.py --out docs/bench [--max-tokens 128] [--repeats 3] [--batches 1 2 4 8] [--ks 0 1 2 3]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from ascend_spec import spec_decode
from ascend_spec.config import EngineConfig, SpeculativeConfig, TorchairGraphConfig
from ascend_spec.engine import Engine
from ascend_spec.graph.model import DeepseekV3ForCausalLM
from ascend_spec.graph.steps import make_draft_step, make_target_step
from ascend_spec.graph.weights import load_model
from ascend_spec.models import BUNDLED_MODEL_DIR
from ascend_spec.sampling import SamplingParams, SamplingTensors
from ascend_spec.tokenizer import TextTokenizer

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n", "class Stack:\n    def __init__(self",
           "for i in range(10):\n", "    return", "raise ValueError(", "with open(path) as f:\n",
           "def __repr__(self):\n        return"]
MAX_MODEL_LEN = 256
CONTEXT = 128  # step-cost inputs sit ~100 tokens into the context


def interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds per callable, timing them round-robin so machine noise hits every contender alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def compiled(fn: Callable) -> Callable:
    return torch.compile(fn, fullgraph=True, dynamic=False)


# -- 1. step costs ------------------------------------------------------------------------------------
def step_costs(model: DeepseekV3ForCausalLM, batches: list[int], k: int, repeats: int) -> dict[int, dict[str, float]]:
    """Seconds per piece and bucket: target (1 token), draft (1 token), and a K-step's target / draft / sampling."""
    cfg = model.cfg
    m = CONTEXT // 16
    out: dict[int, dict[str, float]] = {}
    target = make_target_step(model)
    draft1, draft_k = make_draft_step(model, 1, MAX_MODEL_LEN), make_draft_step(model, k, MAX_MODEL_LEN)

    def sampling(input_ids, logits, num_draft, hidden_rows):
        st = SamplingTensors(*hidden_rows, all_greedy=True, any_top_k=False, any_top_p=False)
        sampled = spec_decode.rejection_sample(input_ids[:, 1:], num_draft, logits, st)
        nxt, valid = spec_decode.prepare_next_token_ids_padded(sampled, torch.zeros_like(num_draft, dtype=torch.bool),
                                                               input_ids[:, 0], cfg.vocab_size)
        qsl = torch.arange(input_ids.shape[0] + 1) * input_ids.shape[1]
        return nxt, spec_decode.prepare_inputs_padded(qsl, num_draft, valid)[0]

    fns = {name: compiled(f) for name, f in (("target", target), ("draft", draft1), ("sampling", sampling))}
    draft_k_c = compiled(draft_k)
    gen = torch.Generator().manual_seed(0)
    for b in batches:
        caches = tuple(torch.zeros(b * m + 1, 16, cfg.latent_dim) for _ in range(cfg.num_hidden_layers))
        dcache = torch.zeros(b * m + 1, 16, cfg.latent_dim)
        table = torch.arange(b).view(-1, 1) * m + torch.arange(m) + 1

        def batch(q: int) -> list[torch.Tensor]:
            pos = 100 + torch.arange(q).expand(b, q)
            slots = torch.gather(table, 1, pos // 16) * 16 + pos % 16
            return [torch.randint(1, cfg.vocab_size, (b, q), generator=gen), pos, slots, table, pos[:, -1] + 1]

        one, verify = batch(1), batch(1 + k)
        hid1, hidk = torch.randn(b, 1, cfg.hidden_size, generator=gen), torch.randn(b, 1 + k, cfg.hidden_size, generator=gen)
        logits = torch.randn(b, 1 + k, cfg.vocab_size, generator=gen)
        st = SamplingTensors.greedy_batch(b)
        rows = (st.temperature, st.top_k, st.top_p, st.greedy)
        nd = torch.full((b,), k)
        zero = torch.zeros(b, dtype=torch.long)
        out[b] = interleaved_medians({
            "target_1": lambda: fns["target"](*one, caches),
            "draft_1": lambda: fns["draft"](one[0], one[1], hid1, zero, one[2], one[3], one[4], dcache),
            "target_verify": lambda: fns["target"](*verify, caches),
            "draft_chain": lambda: draft_k_c(verify[0], verify[1], hidk, zero + k, verify[2], verify[3], verify[4],
                                             dcache),
            "sampling": lambda: fns["sampling"](verify[0], logits, nd, rows),
        }, repeats)
    return out


# -- 2. end to end ------------------------------------------------------------------------------------
def make_engine(model: DeepseekV3ForCausalLM, k: int, batches: list[int], adaptive: bool) -> Engine:
    spec = SpeculativeConfig(num_speculative_tokens=k) if k else None
    cfg = EngineConfig(max_model_len=MAX_MODEL_LEN, max_num_seqs=max(batches), speculative=spec,
                       graph=TorchairGraphConfig(backend="inductor", graph_batch_sizes=tuple(batches)),
                       adaptive_k=adaptive)
    return Engine(model, cfg)


def end_to_end(model: DeepseekV3ForCausalLM, ks: list[int], batches: list[int], max_tokens: int,
               repeats: int) -> tuple[list[dict], dict]:
    """K = 0 is an engine without speculation; K >= 1 and adaptive share one engine whose warm-up compiles every
    K (``force_k`` pins one), so each graph compiles once."""
    tok = TextTokenizer(BUNDLED_MODEL_DIR)
    prompts = [tok.encode(p) for p in PROMPTS]
    k_max = max(ks)
    engines = {"no-spec": make_engine(model, 0, batches, False)}
    if k_max:
        engines["spec"] = make_engine(model, k_max, batches, True)
    compile_s = {}
    for name, eng in engines.items():
        t0 = time.perf_counter()
        eng.warmup(progress=False)
        compile_s[name] = time.perf_counter() - t0
        print(f"warm-up {name}: {compile_s[name]:.0f} s", flush=True)
    contenders = {f"K={k}": (engines["spec"] if k else engines["no-spec"], k if k else None) for k in ks}
    if k_max:
        contenders["adaptive"] = (engines["spec"], None)

    def run(name: str, batch: list[list[int]]):
        eng, force = contenders[name]
        eng.force_k = force
        return eng.generate(batch, SamplingParams(), max_tokens)

    rows = []
    for b in batches:
        batch = [prompts[i % len(prompts)] for i in range(b)]
        runs: dict[str, list] = {name: [] for name in contenders}
        for _ in range(repeats):
            for name in contenders:
                outs, stats, metrics = run(name, batch)
                runs[name].append((stats, metrics, [o.token_ids for o in outs]))
        base_rate = statistics.median(s.generated_tokens / s.decode_seconds for s, _, _ in runs["K=0"])
        reference = runs["K=0"][0][2]
        for name, rs in runs.items():
            stats, metrics, tokens = rs[-1]
            rate = statistics.median(s.generated_tokens / s.decode_seconds for s, _, _ in rs)
            per_step = (stats.generated_tokens - b) / stats.request_steps
            speedup = rate / base_rate
            rows.append({
                "batch": b, "contender": name, "tokens_per_s": rate, "speedup": speedup,
                "tokens_per_request_step": per_step, "efficiency": speedup / per_step,
                "host_us_per_step": 1e6 * statistics.median(s.host_seconds / max(1, sum(s.steps_per_k.values()))
                                                            for s, _, _ in rs),
                "acceptance_per_position": metrics.acceptance_per_position if metrics else [],
                "steps_per_k": dict(stats.steps_per_k), "k_by_bucket": dict(stats.k_by_bucket),
                "same_tokens_as_no_spec": tokens == reference,
            })
            r = rows[-1]
            print(f"| {b} | {name} | {rate:.1f} | {speedup:.2f}x | {per_step:.2f} | {r['efficiency']:.2f} | "
                  f"{r['host_us_per_step']:.0f} | {r['same_tokens_as_no_spec']} |", flush=True)
    if k_max:
        eng = engines["spec"]
        for b in batches:
            contexts = {c: eng.time_step(b, k_max, c, repeats=3 * repeats)
                        for c in (128, 256, MAX_MODEL_LEN) if c <= MAX_MODEL_LEN}
            rows.append({"batch": b, "contender": "context", "k": k_max, "step_seconds_by_context": contexts})
            print(f"batch {b}, K={k_max}: step ms by context width " +
                  ", ".join(f"{c}: {t * 1e3:.2f}" for c, t in contexts.items()), flush=True)
    return rows, compile_s


# -- 3. report ------------------------------------------------------------------------------------------
def write_report(out: Path, costs: dict, k_cost: int, rows: list[dict], compile_s: dict, meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    contexts = [r for r in rows if r["contender"] == "context"]
    rows = [r for r in rows if r["contender"] != "context"]
    batches = sorted({r["batch"] for r in rows})
    names = list(dict.fromkeys(r["contender"] for r in rows))

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in names:
        ax.plot(batches, [next(r["tokens_per_s"] for r in rows if r["batch"] == b and r["contender"] == name)
                          for b in batches], marker="o", label=name)
    ax.set(xlabel="batch size (requests)", ylabel="generated tokens/s", xscale="log", xticks=batches,
           xticklabels=[str(b) for b in batches], title="Greedy decoding, fused graph step")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "tokens_per_s.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        if r["batch"] == batches[0] and r["acceptance_per_position"] and r["contender"].startswith("K="):
            acc = r["acceptance_per_position"]
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=r["contender"])
    ax.set(xlabel="draft position", ylabel="accepted / drafted", ylim=(0, 1),
           title=f"Acceptance per position (batch {batches[0]})")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "acceptance.png", dpi=120)
    plt.close(fig)

    host = {r["batch"]: r["host_us_per_step"] / 1e3 for r in rows if r["contender"] == f"K={k_cost}"}
    parts = [("target verify", "target_verify"), ("draft chain", "draft_chain"), ("sampling", "sampling")]
    fig, ax = plt.subplots(figsize=(6, 4))
    bottom = [0.0] * len(batches)
    for label, key in parts:
        vals = [costs[b][key] * 1e3 for b in batches]
        ax.bar([str(b) for b in batches], vals, bottom=bottom, label=label)
        bottom = [x + y for x, y in zip(bottom, vals)]
    ax.bar([str(b) for b in batches], [host.get(b, 0.0) for b in batches], bottom=bottom, label="host")
    ax.set(xlabel="batch size", ylabel="ms per step", title=f"Step-time breakdown, K={k_cost}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "step_breakdown.png", dpi=120)
    plt.close(fig)

    lines = [f"# Benchmark: speculation vs none ({meta['model']})", "",
             f"{meta['machine']}; torch {meta['torch']}, {meta['threads']} threads; greedy, {meta['max_tokens']} "
             f"tokens per request, max_model_len {MAX_MODEL_LEN}, inductor, fused one-graph step; medians of "
             f"{meta['repeats']} interleaved runs. Command: `{meta['command']}`", "",
             "## Step costs (ms, compiled)", "",
             f"| batch | target step (1 token) | draft step (1 token) | draft ÷ target | target verify ({1 + k_cost} tokens) "
             f"| draft chain (K={k_cost}) | sampling + bookkeeping |", "|---|---|---|---|---|---|---|"]
    for b in batches:
        c = costs[b]
        lines.append(f"| {b} | {c['target_1'] * 1e3:.2f} | {c['draft_1'] * 1e3:.2f} | {c['draft_1'] / c['target_1']:.3f} | "
                     f"{c['target_verify'] * 1e3:.2f} | {c['draft_chain'] * 1e3:.2f} | {c['sampling'] * 1e3:.3f} |")
    lines += ["", "## End to end", "",
              "| batch | contender | tokens/s | vs K=0 | tokens per request-step | efficiency | host µs/step | "
              "K per bucket (adaptive) | same tokens as K=0 |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kb = r["k_by_bucket"].get(r["batch"], "") if r["contender"] == "adaptive" else ""
        lines.append(f"| {r['batch']} | {r['contender']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | "
                     f"{r['tokens_per_request_step']:.2f} | {r['efficiency']:.2f} | {r['host_us_per_step']:.0f} | {kb} | "
                     f"{r['same_tokens_as_no_spec']} |")
    if contexts:
        widths = list(contexts[0]["step_seconds_by_context"])
        lines += ["", f"## Step time by context width (ms, K={contexts[0]['k']}, fused step)", "",
                  "| batch | " + " | ".join(f"{w} keys" for w in widths) + " |", "|---" * (len(widths) + 1) + "|"]
        lines += [f"| {c['batch']} | " + " | ".join(f"{c['step_seconds_by_context'][w] * 1e3:.2f}" for w in widths)
                  + " |" for c in contexts]
    lines += ["", "Warm-up (compile) seconds: " + ", ".join(f"{n} {s:.0f}" for n, s in compile_s.items()), "",
              "![tokens/s](tokens_per_s.png) ![acceptance](acceptance.png) ![breakdown](step_breakdown.png)", ""]
    (out / "results.md").write_text("\n".join(lines))
    (out / "results.json").write_text(json.dumps({"meta": meta, "step_costs": costs, "end_to_end": rows, "context": contexts,
                                                  "compile_seconds": compile_s}, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("docs/bench"))
    ap.add_argument("--model", type=Path, default=BUNDLED_MODEL_DIR)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--cost-k", type=int, default=2, help="K of the step-time breakdown")
    args = ap.parse_args()
    if 0 not in args.ks:
        ap.error("--ks must include 0 (the no-speculation baseline)")
    torch.manual_seed(0)
    model = load_model(args.model)
    meta = {"model": args.model.name, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "machine": f"{platform.machine()}, {torch.get_num_threads()} cores", "max_tokens": args.max_tokens,
            "repeats": args.repeats, "command": "python tools/bench.py " + " ".join(
                f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                for k, v in vars(args).items() if k not in ("out", "model"))}
    with torch.no_grad():
        print("| batch | contender | tok/s | vs K=0 | tokens/request-step | efficiency | host µs/step | same tokens |")
        rows, compile_s = end_to_end(model, args.ks, args.batches, args.max_tokens, args.repeats)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "end_to_end.json").write_text(json.dumps(rows, indent=2) + "\n")  # kept if the rest is cut short
        costs = step_costs(model, args.batches, args.cost_k, max(10, 5 * args.repeats))
        for b, c in costs.items():
            print(f"batch {b}: target {c['target_1'] * 1e3:.2f} ms, draft {c['draft_1'] * 1e3:.2f} ms, "
                  f"ratio {c['draft_1'] / c['target_1']:.3f}", flush=True)
    write_report(args.out, costs, args.cost_k, rows, compile_s, meta)
    print(f"wrote {args.out}/results.md and plots")


if __name__ == "__main__":
    main()
