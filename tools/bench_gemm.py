#!/usr/bin/env python3
"""What a verify of 1 + K tokens costs against one token on this CPU, and which GEMM kernel sets it.

Two measurements, contenders interleaved (round-robin medians), fp32, the bundled model's weights:

- **products** (default): the model's linear products (every layer's, the lm_head's) for ``M`` tokens, summed, with
  three kernels: MKL ``x·Wᵀ`` (``F.linear``), MKL ``W·xᵀ`` (what the engine runs on CPU, ``graph.layers.Linear``:
  weight-left, a lone token padded to two) and oneDNN on a prepacked weight (``mkldnn._linear_pointwise``, what
  inductor emits when it freezes weights). Each column's ``× M=1`` says what M tokens cost against one token on the
  same kernel.
- ``--steps``: the target forward (``graph.steps.make_target_step``, ``B`` rows × ``Q`` tokens, context 128) compiled
  as the engine compiles it on CPU (MKL W·xᵀ, and row reductions for one or two rows in a one-row graph), against
  the same forward compiled with inductor's weight freezing (oneDNN on
  prepacked weights; no weight-left products, no nested compile regions, which freezing cannot see into): the
  verify ÷ step(1) ratio the adaptive policy and the speed-up limit are made of, and each variant's compile time.

    python tools/bench_gemm.py [--tokens 1 2 4 8 16 32] [--repeats 30]
    python tools/bench_gemm.py --steps [--batches 1 8] [--queries 1 2 4] [--repeats 30]
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

from ascend_spec.graph.backends.inductor import InductorBackend, mark_dims
from ascend_spec.graph.backends.base import DynamicDims
from ascend_spec.graph.backends.compile_cache import open_default_cache
from ascend_spec.graph.layers import Linear
from ascend_spec.graph.model import DeepseekV3ForCausalLM
from ascend_spec.graph.steps import make_target_step
from ascend_spec.graph.weights import load_model
from ascend_spec.kv_cache import KVCaches
from ascend_spec.models import BUNDLED_MODEL_DIR

from timing import interleaved_medians  # this folder is on sys.path

CONTEXT = 128
ENGINE, FROZEN = "engine", "frozen (oneDNN prepacked)"
#: target step arguments: input_ids, positions, slot_mapping, block_table (batch and width), seq_lens
TARGET_DIMS = DynamicDims(batch=(0, 1, 2, 3, 4), width=(3,))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(BUNDLED_MODEL_DIR))
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32], help="products: token counts M")
    p.add_argument("--steps", action="store_true", help="time the compiled target forward instead of the products")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="--steps: rows B")
    p.add_argument("--queries", type=int, nargs="+", default=[1, 2, 4], help="--steps: tokens per row Q (1 + K)")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args(argv)


def linear_weights(model: DeepseekV3ForCausalLM) -> list[torch.Tensor]:
    return [m.weight.detach() for m in model.modules() if isinstance(m, Linear) and m.bias is None]


def product_kernels(weights: list[torch.Tensor], m: int) -> dict[str, Callable[[], object]]:
    """One callable per kernel, each running every product of the model on ``m`` tokens."""
    x = {w.shape[1]: torch.randn(m, w.shape[1]) for w in weights}
    left = []
    for w in weights:
        lin = Linear(w.shape[1], w.shape[0], bias=False)
        lin.weight = torch.nn.Parameter(w, requires_grad=False)
        lin.weight_left = True
        left.append(lin)
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, max(m, 2)) for w in weights]
    return {
        "MKL x·Wᵀ": lambda: [F.linear(x[w.shape[1]], w) for w in weights],
        "MKL W·xᵀ (engine)": lambda: [lin(x[lin.in_features]) for lin in left],
        "oneDNN prepacked": lambda: [torch.ops.mkldnn._linear_pointwise(x[w.shape[1]], p, None, "none", [], "")
                                     for w, p in zip(weights, packed)],
    }


def bench_products(model: DeepseekV3ForCausalLM, tokens: list[int], repeats: int) -> None:
    weights = linear_weights(model)
    mb = sum(w.numel() * w.element_size() for w in weights) / 2**20
    print(f"{len(weights)} products, {mb:.1f} MiB of weights; ms per step for M tokens (× M=1: same kernel)\n")
    rows: dict[int, dict[str, float]] = {}
    with torch.no_grad():
        for m in tokens:
            rows[m] = interleaved_medians(product_kernels(weights, m), repeats)
    names = list(next(iter(rows.values())))
    print("| M | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    first = rows[tokens[0]]
    for m, r in rows.items():
        cells = [f"{r[n] * 1e3:.2f} ({r[n] / first[n]:.2f}×)" for n in names]
        print(f"| {m} | " + " | ".join(cells) + " |")


def target_inputs(b: int, q: int, max_blocks: int) -> list[torch.Tensor]:
    positions = (CONTEXT + torch.arange(q)).expand(b, q).contiguous()
    width = -(-(CONTEXT + q) // 16)
    table = torch.arange(1, 1 + b * max_blocks).view(b, max_blocks)[:, :width].contiguous()
    return [torch.zeros(b, q, dtype=torch.long), positions, torch.full((b, q), -1, dtype=torch.long), table,
            torch.full((b,), CONTEXT + q, dtype=torch.long)]


def bench_steps(model: DeepseekV3ForCausalLM, batches: list[int], queries: list[int], repeats: int) -> None:
    backend = InductorBackend(torch.device("cpu"))
    model.use_backend(backend)
    caches = KVCaches.allocate(model.cfg, 512, max(batches), "cpu")
    max_blocks = caches.max_blocks_per_seq

    def setup(frozen: bool) -> None:
        for module in model.modules():
            if isinstance(module, Linear):
                module.weight_left = not frozen
        model.set_compile_regions(not frozen)

    variants = {ENGINE: False, FROZEN: True}  # name: frozen
    compiled = {name: torch.compile(make_target_step(model), fullgraph=True, dynamic=None) for name in variants}
    compile_s: dict[str, float] = {}

    def runner(name: str, args: list[torch.Tensor]) -> Callable[[], object]:
        def run() -> object:
            setup(variants[name])
            mark_dims(tuple(args), TARGET_DIMS)
            return compiled[name](*args, caches.target)
        return run

    results: dict[tuple[int, int], dict[str, float]] = {}
    with torch.no_grad():
        for b in batches:
            for q in queries:
                args = target_inputs(b, q, max_blocks)
                fns = {name: runner(name, args) for name in variants}
                logits = {}
                for name, fn in fns.items():  # compile before timing
                    t0 = time.perf_counter()
                    with torch._inductor.config.patch(freezing=variants[name]):
                        logits[name] = fn()[1]
                    compile_s[name] = compile_s.get(name, 0.0) + time.perf_counter() - t0
                diff = (logits[FROZEN] - logits[ENGINE]).abs().max().item()
                if diff > 1e-3:
                    sys.exit(f"B={b} Q={q}: the frozen forward's logits differ from the engine's by {diff:.2e}")
                results[(b, q)] = interleaved_medians(fns, repeats)
    print("| B | Q | " + " | ".join(f"{n}: ms (÷ Q=1)" for n in variants) + " |")
    print("|---|---|" + "---|" * len(variants))
    for (b, q), r in results.items():
        base = results[(b, queries[0])]
        print(f"| {b} | {q} | " + " | ".join(f"{r[n] * 1e3:.2f} ({r[n] / base[n]:.2f})" for n in variants) + " |")
    print("\ncompile seconds (first call of every B, Q): "
          + ", ".join(f"{n} {s:.0f}" for n, s in compile_s.items()))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    open_default_cache()  # inductor's working cache in the engine's private cache folder, as the engine does
    model = load_model(args.model).eval()
    print(f"{torch.__version__}, {args.threads} threads, MKL {torch.backends.mkl.is_available()}, "
          f"oneDNN {torch.backends.mkldnn.is_available()}")
    if args.steps:
        bench_steps(model, args.batches, args.queries, args.repeats)
    else:
        bench_products(model, args.tokens, args.repeats)


if __name__ == "__main__":
    main()
