"""Harness soak: many decode steps with random arrivals, prompt lengths and max_tokens, greedy and seeded sampling.

The batch size wanders across every graph bucket, and the KV pool (``KV_BLOCKS``) holds about a third of what a
full batch can ask for, so bursts preempt and recompute requests. Checked after every round (one ``generate``
call): every KV block is back in the pool, nothing recompiled after warm-up, each greedy request equals its run
without speculation; at the end, the process RSS is where it was after the first round and the first round,
run again with its seed, gives the same tokens (sampled requests included). ``test_soak_ci`` fits CI; ``test_soak_long``
(marker ``soak``, excluded by default; ``make soak``) runs 10,000 steps.
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
import torch

from ascend_spec.config import EngineConfig, SpeculativeConfig, GraphModeConfig
from ascend_spec.engine import load_engine
from ascend_spec.graph.latent_cache import num_blocks_for
from ascend_spec.sampling import GREEDY, RANDOM, SamplingParams
from ascend_spec.tokenizer import TextTokenizer

BUCKETS = (1, 2, 4, 8)
MAX_NUM_SEQS = 8
MAX_MODEL_LEN = 128
REQUESTS_PER_ROUND = 48
RSS_TOLERANCE = 0.05
KV_BLOCKS = 3 * num_blocks_for(MAX_MODEL_LEN, 16) + 1
SAMPLED = SamplingParams(temperature=0.8, top_k=20, top_p=0.95)
LOGPROBS = SamplingParams(logprobs=2)


@dataclass
class SoakReport:
    steps: int = 0
    requests: int = 0
    greedy_checked: int = 0
    tokens: int = 0
    preemptions: int = 0
    total_blocks: int = 0
    batch_sizes: set[int] = field(default_factory=set)
    rss: list[int] = field(default_factory=list)


def _corpus(trained_dir: Path) -> list[int]:
    """Token ids of real code (what the trained fixture learned from): prompts are random slices of it."""
    import ascend_spec.engine as src

    return TextTokenizer(trained_dir).encode(Path(src.__file__).read_text())


def _round(rng: random.Random, corpus: list[int]):
    prompts, params, max_tokens, arrivals, t = [], [], [], [], 0
    for _ in range(REQUESTS_PER_ROUND):
        n = rng.randint(1, 48)
        start = rng.randrange(len(corpus) - n)
        prompts.append(corpus[start: start + n])
        r = rng.random()
        params.append(SamplingParams() if r < 0.4 else LOGPROBS if r < 0.5 else SAMPLED)
        max_tokens.append(rng.randint(1, 64))
        # bursts and lulls: the running batch climbs to max_num_seqs and drains to 1
        t += 0 if rng.random() < 0.3 else int(rng.expovariate(1 / 6))
        arrivals.append(t)
    return prompts, params, max_tokens, arrivals


def soak(trained_dir: Path, num_steps: int, backend: str, seed: int = 0) -> SoakReport:
    graph = GraphModeConfig(backend=backend, graph_batch_sizes=BUCKETS)
    spec = load_engine(trained_dir, EngineConfig(max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
                                                 speculative=SpeculativeConfig(num_speculative_tokens=2), graph=graph,
                                                 kv_blocks=KV_BLOCKS, adaptive_k=False))
    ref = load_engine(trained_dir, EngineConfig(max_model_len=MAX_MODEL_LEN, max_num_seqs=16, speculative=None,
                                                graph=GraphModeConfig(enabled=False)))
    if backend != "eager":
        # the soak samples and asks for logprobs too: every path replays warm graphs
        spec.warmup(progress=False, modes=(GREEDY, RANDOM))
        spec.warmup(progress=False, modes=(GREEDY, RANDOM), logprobs=True)
    report = SoakReport(total_blocks=spec.caches.allocator.num_free)
    rng = random.Random(seed)
    corpus = _corpus(trained_dir)
    run = spec.runner.run

    def tracking(plan, *args):
        if plan.running:
            report.batch_sizes.add(len(plan.running))
        return run(plan, *args)

    spec.runner.run = tracking
    rounds, first = 0, None
    with torch.compiler.set_stance("fail_on_recompile"):
        while report.steps < num_steps:
            prompts, params, max_tokens, arrivals = _round(rng, corpus)
            outs, stats, _ = spec.generate(prompts, params, max_tokens, seed=seed + rounds, arrivals=arrivals)
            if first is None:
                first = (prompts, params, max_tokens, arrivals), [o.token_ids for o in outs]
            rounds += 1
            report.steps += stats.num_steps
            report.requests += len(prompts)
            report.tokens += stats.generated_tokens
            report.preemptions += stats.preemptions
            assert spec.caches.allocator.num_free == report.total_blocks, f"round {rounds}: KV blocks leaked"
            assert stats.recompiles_after_warmup == 0, f"round {rounds}: recompiled"
            failed = {name: n for name, n in spec.runner.graphs.failures().items() if n}
            assert not failed, f"round {rounds}: graphs failed (and reran eagerly): {failed}"
            greedy = [i for i, p in enumerate(params) if p.is_greedy]
            expected, _, _ = ref.generate([prompts[i] for i in greedy], SamplingParams(),
                                          [max_tokens[i] for i in greedy])
            for i, e in zip(greedy, expected):
                assert outs[i].token_ids == e.token_ids, f"round {rounds} request {i}: spec != no-spec"
            report.greedy_checked += len(greedy)
            for o, n in zip(outs, max_tokens):
                assert 1 <= len(o.token_ids) <= n and o.finish_reason in ("stop", "length", "max_model_len")
            report.rss.append(psutil.Process().memory_info().rss)
        # seeded sampling is reproducible: the first round again, same seed, same tokens (sampled ones included)
        again, _, _ = spec.generate(*first[0][:3], seed=seed, arrivals=first[0][3])
        assert [o.token_ids for o in again] == first[1], "seeded sampling did not reproduce"
    return report


def _check(report: SoakReport, num_steps: int) -> None:
    print(f"soak: {report.steps} steps, {report.requests} requests ({report.greedy_checked} greedy checked), "
          f"{report.tokens} tokens, batch sizes {sorted(report.batch_sizes)}, {report.preemptions} preemptions, "
          f"{report.total_blocks} KV blocks all free after every round, "
          f"RSS {report.rss[0] / 2**20:.0f} -> {report.rss[-1] / 2**20:.0f} MiB")
    assert report.steps >= num_steps
    assert report.preemptions > 0, "the pool never ran short: preemption untested"
    for lo, hi in zip((0,) + BUCKETS, BUCKETS):  # every bucket served at least one batch of its own range
        assert report.batch_sizes & set(range(lo + 1, hi + 1)), (lo, hi, report.batch_sizes)
    assert abs(report.rss[-1] - report.rss[0]) <= RSS_TOLERANCE * report.rss[0], report.rss


@pytest.mark.slow  # 600 eager steps: minutes on a 2-core host
def test_soak_ci(trained_dir):
    _check(soak(trained_dir, 600, backend="eager"), 600)


@pytest.mark.soak
def test_soak_long(trained_dir):
    steps = int(os.environ.get("ASCEND_SPEC_SOAK_STEPS", "10000"))
    _check(soak(trained_dir, steps, backend="inductor"), steps)
