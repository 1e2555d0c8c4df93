#!/usr/bin/env python3
"""Does a sparse draft step cost what its top-k costs? The K-step MTP chain's time at live context 512 and 8,192.

    python tools/bench_dsa_context.py                      # the bundled DSA miniature beside the bundled DeepSeek-V3
    python tools/bench_dsa_context.py --models DIR --contexts 512 8192 32768 --batches 1 8
    python tools/bench_dsa_context.py --glm5-widths        # also GLM-5's own widths (random weights, ~13 GB)

Each request holds ``context`` tokens (random latents and index keys in the caches: costs follow shapes, not
values); the draft chain (``graph.steps.make_draft_step``, eager) drafts ``K`` tokens from a verified block of
``1 + K``. Medians of interleaved repeats; each ratio is to the first context of the same model and batch. With
DeepSeek Sparse Attention the attention reads ``index_topk`` tokens whatever the context; the indexer still scores
every live key (its cost is the part that grows). Dense MLA (DeepSeek-V3) reads every live token. The
checkpoints' ``max_position_embeddings`` are raised to the longest context (weights linked, not copied).

A miniature's layer is so narrow that the indexer's scoring (linear in the context) is a large share of its step.
``--glm5-widths`` adds a model at GLM-5's own widths (transformers' ``GlmMoeDsaConfig`` defaults: hidden 6,144,
vocabulary 154,880, 64 heads, indexer 32 × 128), random weights, one target layer, its MTP layer's MoE cut from
256 routed experts to ``--glm5-experts`` (each token still runs 8 of them: a token's work is GLM-5's) and
``index_topk`` set below the shortest context (``--glm5-topk``). Unsharded, as one device of a tensor-parallel
group would hold it were the indexer split too (vLLM replicates the indexer across tensor-parallel ranks: there
its share of a step grows with the group).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ascend_spec.graph.families import build_model, config_from_hf
from ascend_spec.graph.latent_cache import cache_tensors
from ascend_spec.graph.steps import make_draft_step, slots_for
from ascend_spec.graph.weights import load_model
from ascend_spec.models import BUNDLED_DSA_MODEL_DIR, BUNDLED_MODEL_DIR
from bench_context import checkpoint_with_positions  # tools/: the same checkpoint, its positions raised

BLOCK = 16


def glm5_width_model(positions: int, topk: int, experts: int):
    """A random-weight model at GLM-5's widths (see the module doc), fp32."""
    from transformers import GlmMoeDsaConfig  # the test extras' transformers

    from ascend_spec_tools.tiny_models import random_weights

    hf = GlmMoeDsaConfig().to_dict()
    hf.update(num_hidden_layers=1, mlp_layer_types=None, indexer_types=["full"], first_k_dense_replace=1,
              n_routed_experts=experts, index_topk=topk, num_nextn_predict_layers=1,
              architectures=["GlmMoeDsaForCausalLM"], max_position_embeddings=positions)
    return random_weights(build_model(config_from_hf(hf)), std=0.02)


def draft_inputs(model, batch: int, context: int, k: int, gen: torch.Generator) -> tuple:
    q = 1 + k
    blocks = -(-(context + k) // BLOCK)
    table = torch.arange(1, batch * blocks + 1).view(batch, blocks)
    cache = model.cfg.layer_cache("pair", batch * blocks + 1, BLOCK, model.lm_head.weight.dtype, "cpu")
    for t in cache_tensors(cache):
        t.copy_(torch.randn(t.shape, generator=gen))
    seq_lens = torch.full((batch,), context)
    positions = seq_lens.view(-1, 1) - q + torch.arange(q)
    return (torch.randint(1, model.cfg.vocab_size, (batch, q), generator=gen), positions,
            torch.randn(batch, q, model.cfg.hidden_size, generator=gen), torch.full((batch,), q - 1),
            slots_for(positions, table, BLOCK), table, seq_lens, torch.full((batch,), context + 4 * k), cache)


def median_ms_by_context(step, inputs: dict[int, tuple], rounds: int, repeats: int) -> dict[int, float]:
    """Median ms of ``step`` on each context's inputs, timed in interleaved rounds (each round times every context)."""
    times: dict[int, list[float]] = {c: [] for c in inputs}
    with torch.no_grad():
        for args in inputs.values():
            step(*args)  # warm
        for _ in range(rounds):
            for c, args in inputs.items():
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    step(*args)
                    times[c].append(time.perf_counter() - t0)
    return {c: statistics.median(ts) * 1e3 for c, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=Path, nargs="+", default=[BUNDLED_DSA_MODEL_DIR, BUNDLED_MODEL_DIR])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 8192])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--glm5-widths", action="store_true", help="also a model at GLM-5's widths (module doc)")
    ap.add_argument("--glm5-topk", type=int, default=256)
    ap.add_argument("--glm5-experts", type=int, default=16)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []
    positions = max(args.contexts) + 4 * args.k
    with tempfile.TemporaryDirectory(prefix="bench_dsa_context_") as tmp:
        scratch = Path(tmp)
        models = [(path.name, lambda p=path: load_model(checkpoint_with_positions(p, positions, scratch / p.name)))
                  for path in args.models]
        if args.glm5_widths:
            models.append((f"GLM-5 widths, {args.glm5_experts} experts",
                           lambda: glm5_width_model(positions, args.glm5_topk, args.glm5_experts)))
        for name, load in models:
            model = load()
            sa = model.cfg.sparse_attention()
            kind = f"DSA top-{sa['index_topk']}" if sa else "dense MLA"
            step = make_draft_step(model, args.k, positions)
            for batch in args.batches:
                inputs = {c: draft_inputs(model, batch, c, args.k, gen) for c in args.contexts}
                med = median_ms_by_context(step, inputs, args.rounds, args.repeats)
                first = args.contexts[0]
                rows.append((name, kind, batch, med, {c: med[c] / med[first] for c in args.contexts}))
    print(f"draft chain K={args.k}, eager, medians of {args.rounds}×{args.repeats}; ms (ratio to context "
          f"{args.contexts[0]})")
    header = "| model | attention | batch | " + " | ".join(f"context {c:,}" for c in args.contexts) + " |"
    print(header)
    print("|" + "---|" * (3 + len(args.contexts)))
    for name, kind, batch, med, ratio in rows:
        cells = " | ".join(f"{med[c]:.2f} ({ratio[c]:.2f}×)" for c in args.contexts)
        print(f"| {name} | {kind} | {batch} | {cells} |")


if __name__ == "__main__":
    main()
