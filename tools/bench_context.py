#!/usr/bin/env python3
"""Does a step cost what the live context costs? Target and draft step time by ``max_model_len``, side by side.

    python tools/bench_context.py                         # 8 requests at context 64; max_model_len 512 / 8192 / 32768
    python tools/bench_context.py --batch 4 --context 200 --lens 512 4096

For each ``max_model_len`` (a copy of the bundled checkpoint whose ``max_position_embeddings`` allows it) two
contenders run the same compiled graphs (inductor, one compile each with a dynamic batch and width):
``live`` passes block tables trimmed to the live blocks (what the engine does on CPU), ``full-width`` the whole
``max_model_len`` table (the gather reference's cost: what every step paid before context became data). The
target step verifies ``1 + K`` tokens per request; the draft step is the K-step MTP chain. Timings are medians of
interleaved repeats on the same inputs (the cache holds random latents; costs depend on shapes, not values), and
the ratios are to the 512 column of the same contender.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from ascend_spec.config import EngineConfig, SpeculativeConfig, GraphModeConfig
from ascend_spec.engine import Engine
from ascend_spec.timing import time_call
from ascend_spec.graph.latent_cache import DEFAULT_BLOCK_SIZE, cache_tensors
from ascend_spec.graph.paging import live_blocks
from ascend_spec.graph.weights import load_model
from ascend_spec.models import BUNDLED_MODEL_DIR


def checkpoint_with_positions(src: Path, positions: int, dest: Path) -> Path:
    """The checkpoint in ``src`` with ``max_position_embeddings = positions`` (weights linked, not copied)."""
    dest.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg["max_position_embeddings"] = max(positions, cfg["max_position_embeddings"])
    (dest / "config.json").write_text(json.dumps(cfg))
    for f in src.iterdir():
        if f.name != "config.json" and not (dest / f.name).exists():
            (dest / f.name).symlink_to(f.resolve())
    return dest


def step_inputs(eng: Engine, batch: int, context: int, width: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Target-step and draft-step inputs for ``batch`` live requests that hold ``context`` tokens each."""
    k = eng.k_max
    q = 1 + k
    g = torch.Generator().manual_seed(0)
    for cache in (*eng.caches.target, eng.caches.draft):
        for t in cache_tensors(cache):
            t.normal_(generator=g)
    per_seq = live_blocks(context + 2 * k, eng.caches.max_blocks_per_seq, eng.caches.block_size, minimum=1)
    table = torch.zeros(batch, width, dtype=torch.long)
    for i in range(batch):
        row = torch.arange(1 + i * per_seq, 1 + (i + 1) * per_seq)[:width]
        table[i, : len(row)] = row
    start = torch.full((batch, 1), context - 1)
    positions = start + torch.arange(q)
    slots = torch.gather(table, 1, positions // 16) * 16 + positions % 16
    ids = torch.randint(0, eng.model.cfg.vocab_size, (batch, q), generator=g)
    seq_lens = torch.full((batch,), context - 1 + q)
    hidden = torch.randn(batch, q, eng.model.cfg.hidden_size, generator=g)
    sample_idx = torch.full((batch,), k)
    target = [ids, positions, slots, table, seq_lens]
    draft = [ids, positions, hidden, sample_idx, slots, table, seq_lens, eng.proposer.row_limits(batch, ids.device)]
    return target, draft


def median_ms(fn, repeats: int) -> float:
    return 1e3 * time_call(fn, repeats)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=64, help="tokens each request holds")
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--lens", type=int, nargs="+", default=[512, 8192, 32768], help="max_model_len values")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the contenders")
    args = ap.parse_args(argv)

    results: dict[tuple[str, int], dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        engines = {}
        for n in args.lens:
            model_dir = checkpoint_with_positions(BUNDLED_MODEL_DIR, n, Path(tmp) / f"ctx{n}")
            cfg = EngineConfig(max_model_len=n, max_num_seqs=args.batch, fused_step=False, adaptive_k=False,
                               kv_blocks=live_blocks(n, 1 << 30, DEFAULT_BLOCK_SIZE) + args.batch * 8 + 2,
                               speculative=SpeculativeConfig(num_speculative_tokens=args.k),
                               graph=GraphModeConfig(backend="inductor", graph_batch_sizes=(args.batch,)))
            eng = Engine(load_model(model_dir), cfg)
            t0 = time.perf_counter()
            eng.warmup(progress=False)
            print(f"max_model_len {n}: warm-up {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
            engines[n] = eng
        for _ in range(args.rounds):
            for n, eng in engines.items():
                full = eng.caches.max_blocks_per_seq
                for name, width in (("live", live_blocks(args.context + 2 * args.k, full, eng.caches.block_size)), ("full-width", full)):
                    target, draft = step_inputs(eng, args.batch, args.context, width)
                    runner = eng.runner
                    t = median_ms(lambda: runner.target_graph(target, (eng.caches.target,)), args.repeats)
                    d = median_ms(lambda: eng.proposer._run_draft(*draft), args.repeats)
                    r = results.setdefault((name, n), {"target": [], "draft": []})
                    r["target"].append(t)
                    r["draft"].append(d)
    print(f"\n{args.batch} requests at context {args.context}, K={args.k}, inductor on CPU "
          f"({torch.get_num_threads()} threads); ms per step, median of {args.rounds} interleaved rounds")
    print(f"{'contender':12s} {'max_model_len':>13s} {'target ms':>10s} {'x 512':>6s} {'draft ms':>9s} {'x 512':>6s}")
    for (name, n), r in sorted(results.items()):
        t, d = statistics.median(r["target"]), statistics.median(r["draft"])
        base = results[(name, args.lens[0])]
        t0, d0 = statistics.median(base["target"]), statistics.median(base["draft"])
        print(f"{name:12s} {n:13d} {t:10.2f} {t / t0:6.2f} {d:9.2f} {d / d0:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
