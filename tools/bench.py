#!/usr/bin/env python3
"""Side-by-side benchmark on the bundled model (medians of repeated runs, ratios in one table).

1. Draft-step latency per bucket: eager MtpProposer vs the compiled MtpTorchairProposer (same inputs).
2. End-to-end greedy tokens/s with and without speculation, K = 1, 2, 3, batch 1 and 8, eager and graph mode.
Contenders are timed round-robin (interleaved) so that machine noise hits each alike.

    python tools/bench.py [--backend inductor] [--repeats 3] [--max-tokens 64] [--quick]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from ascend_spec.config import EngineConfig, SpeculativeConfig, TorchairGraphConfig
from ascend_spec.engine import load_engine
from ascend_spec.graph.backends import get_backend
from ascend_spec.graph.weights import load_model
from ascend_spec.models import BUNDLED_MODEL_DIR
from ascend_spec.proposer import DraftInputs, MtpProposer
from ascend_spec.sampling import SamplingParams
from ascend_spec.tokenizer import TextTokenizer
from ascend_spec.torchair_proposer import MtpTorchairProposer

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n", "class Stack:\n    def __init__(self",
           "for i in range(10):\n", "    return", "raise ValueError(", "with open(path) as f:\n",
           "def __repr__(self):\n        return"]
MAX_MODEL_LEN = 256


def interleaved_medians(fns: dict[str, object], repeats: int) -> dict[str, float]:
    """Median seconds per callable, timing them round-robin so machine noise hits every contender alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def draft_inputs(b: int, k: int, hidden_size: int, vocab: int, gen: torch.Generator) -> DraftInputs:
    q = 1 + k
    m = MAX_MODEL_LEN // 16
    start = torch.randint(20, 150, (b, 1), generator=gen)
    positions = start + torch.arange(q)
    table = (torch.arange(b).view(-1, 1) * m + torch.arange(m) + 1)
    slots = torch.gather(table, 1, positions // 16) * 16 + positions % 16
    return DraftInputs(torch.randint(1, vocab, (b, q), generator=gen), positions,
                       torch.randn(b, q, hidden_size, generator=gen), slots,
                       torch.randint(1, vocab, (b,), generator=gen), torch.randint(0, q, (b,), generator=gen),
                       table, positions[:, -1] + 1)


def bench_draft(backend: str, k: int, sizes: list[int], repeats: int) -> None:
    model = load_model(BUNDLED_MODEL_DIR)
    cfg = model.cfg
    spec = SpeculativeConfig(num_speculative_tokens=k)
    cache = torch.zeros(max(sizes) * MAX_MODEL_LEN // 16 + 1, 16, cfg.latent_dim)
    eager = MtpProposer(model, spec, MAX_MODEL_LEN, cache)
    compiled = MtpTorchairProposer(model, spec, MAX_MODEL_LEN, cache, backend=get_backend(backend, "cpu"),
                                   batch_sizes=sizes)
    compiled.warmup(progress=False)
    gen = torch.Generator().manual_seed(0)
    print(f"\n## Draft step latency, K={k} (median of {repeats}; eager vs {backend})")
    print("| bucket | eager ms | graph ms | speed-up |\n|---|---|---|---|")
    for b in sizes:
        inp = draft_inputs(b, k, cfg.hidden_size, cfg.vocab_size, gen)
        assert torch.equal(eager.propose(inp), compiled.propose(inp))
        med = interleaved_medians({"eager": lambda: eager.propose(inp), "graph": lambda: compiled.propose(inp)},
                                  repeats)
        te, tc = med["eager"], med["graph"]
        print(f"| {b} | {te * 1e3:.2f} | {tc * 1e3:.2f} | {te / tc:.2f}x |")


def bench_e2e(backends: list[str], ks: list[int], batches: list[int], max_tokens: int, repeats: int) -> None:
    tok = TextTokenizer(BUNDLED_MODEL_DIR)
    prompts = [tok.encode(p) for p in PROMPTS]
    engines = {}
    for backend in backends:
        for k in ks:
            graph = (TorchairGraphConfig(enabled=False, backend="eager") if backend == "eager"
                     else TorchairGraphConfig(backend=backend, graph_batch_sizes=tuple(batches)))
            spec = SpeculativeConfig(num_speculative_tokens=k) if k else None
            eng = load_engine(BUNDLED_MODEL_DIR, EngineConfig(max_model_len=MAX_MODEL_LEN, max_num_seqs=max(batches),
                                                              speculative=spec, graph=graph))
            if backend != "eager":
                eng.warmup(progress=False)
            engines[(backend, k)] = eng
    print(f"\n## End-to-end greedy tokens/s (median of {repeats} interleaved runs, {max_tokens} tokens per request)")
    print("| backend | K | batch | tok/s | vs no-spec (same backend) | vs eager no-spec | acceptance | mean accepted length |")
    print("|---|---|---|---|---|---|---|---|")
    for b in batches:
        batch = [prompts[i % len(prompts)] for i in range(b)]
        last_metrics: dict[tuple[str, int], object] = {}
        for eng in engines.values():
            eng.generate(batch, SamplingParams(), 8)  # warm allocator and caches
        rates: dict[tuple[str, int], list[float]] = {key: [] for key in engines}
        for _ in range(repeats):
            for key, eng in engines.items():
                _, stats, metrics = eng.generate(batch, SamplingParams(), max_tokens)
                rates[key].append(stats.generated_tokens / stats.decode_seconds)
                last_metrics[key] = metrics
        for (backend, k), rs in rates.items():
            rate = statistics.median(rs)
            base = statistics.median(rates[(backend, 0)]) if (backend, 0) in rates else float("nan")
            eager_base = statistics.median(rates[("eager", 0)]) if ("eager", 0) in rates else float("nan")
            metrics = last_metrics[(backend, k)]
            acc = f"{metrics.acceptance_rate:.2f}" if metrics else "-"
            mal = f"{metrics.mean_accepted_length:.2f}" if metrics else "-"
            print(f"| {backend} | {k} | {b} | {rate:.1f} | {rate / base:.2f}x | {rate / eager_base:.2f}x | {acc} | {mal} |",
                  flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="inductor", choices=["inductor", "eager"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="K=2 only")
    ap.add_argument("--skip-draft", action="store_true")
    ap.add_argument("--skip-e2e", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    ks = [2] if args.quick else [1, 2, 3]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if not args.skip_draft:
        for k in ks:
            bench_draft(args.backend, k, [1, 2, 4, 8], max(args.repeats, 20))
    if not args.skip_e2e:
        backends = ["eager"] + ([args.backend] if args.backend != "eager" else [])
        bench_e2e(backends, [0] + ks, [1, 8], args.max_tokens, args.repeats)


if __name__ == "__main__":
    main()
