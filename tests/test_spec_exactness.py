"""Greedy speculative output equals greedy output without speculation, token for token (bundled checkpoint).

When two greedy runs diverge, the failure message reports the no-spec run's top-2 logit gap at the first differing
token: a gap near float rounding is numerics (docs/design.md, "Exactness"), anything larger is a bug.
"""
import pytest
import torch

from ascend_spec.config import EngineConfig, SpeculativeConfig, GraphModeConfig
from ascend_spec.engine import load_engine
from ascend_spec.graph.weights import load_model
from ascend_spec.sampling import SamplingParams
from ascend_spec.tokenizer import TextTokenizer

from .conftest import matrix

EAGER = GraphModeConfig(enabled=False, backend="eager")
TEXTS = ["def fibonacci(n):\n", "import os\n", "class Stack:\n    def __init__(self", "for i in range(10):\n",
         "x", "    return", '"""Module docstring.\n\nThis module', "if __name__ == '__main__':\n    main(",
         "try:\n    import json\nexcept ImportError:\n", "self.assertEqual(", "def __repr__(self):\n        return",
         "#", "with open(path) as f:\n", "raise ValueError(", "lambda x:", "@property\ndef name(self):\n"]


@pytest.fixture(scope="module")
def setup(trained_dir):
    tok = TextTokenizer(trained_dir)
    prompts = [tok.encode(t) for t in TEXTS]
    # Staggered lengths so the running batch shrinks through every size down to 1.
    max_tokens = [12 + 3 * i for i in range(len(prompts))]
    return trained_dir, prompts, max_tokens


def _run(model_dir, prompts, max_tokens, spec, max_num_seqs=16, max_model_len=256):
    eng = load_engine(model_dir, EngineConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                              speculative=spec, graph=EAGER))
    outs, stats, metrics = eng.generate(prompts, SamplingParams(), max_tokens)
    return [o.token_ids for o in outs], [o.finish_reason for o in outs], metrics


def _top2_gap(model_dir, prompt, generated, index) -> float:
    """No-spec logit gap between the top two tokens where the runs first differ."""
    model = load_model(model_dir)
    ids = torch.tensor([prompt + generated[:index]])
    with torch.no_grad():
        logits = model.logits(model.target_dense(ids))[0, -1]
    top = logits.topk(2).values
    return float(top[0] - top[1])


def assert_same_tokens(model_dir, prompts, ref, got, label):
    for i, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            gap = _top2_gap(model_dir, prompts[i], a, first)
            pytest.fail(f"{label}: prompt {i} diverges at generated token {first} ({a[first:first + 3]} vs "
                        f"{b[first:first + 3]}); no-spec top-2 logit gap there = {gap:.3g}")


@pytest.fixture(scope="module")
def reference(setup):
    model_dir, prompts, max_tokens = setup
    return _run(model_dir, prompts, max_tokens, None)


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("k", [matrix(1), 2, matrix(3)])
def test_greedy_spec_equals_no_spec(setup, reference, k, padded):
    model_dir, prompts, max_tokens = setup
    spec = SpeculativeConfig(num_speculative_tokens=k, disable_padded_drafter_batch=not padded)
    tokens, reasons, metrics = _run(model_dir, prompts, max_tokens, spec)
    assert_same_tokens(model_dir, prompts, reference[0], tokens, f"K={k} {'padded' if padded else 'unpadded'}")
    assert reasons == reference[1]
    # The trained MTP head must actually be drafting useful tokens, not just be harmless.
    assert metrics.acceptance_rate > 0.3, metrics.as_dict()


@pytest.mark.parametrize("batch", [1, 5])
def test_small_batches(setup, batch):
    model_dir, prompts, max_tokens = setup
    ref, _, _ = _run(model_dir, prompts[:6], max_tokens[:6], None, max_num_seqs=batch)
    got, _, _ = _run(model_dir, prompts[:6], max_tokens[:6], SpeculativeConfig(num_speculative_tokens=2),
                     max_num_seqs=batch)
    assert_same_tokens(model_dir, prompts[:6], ref, got, f"batch {batch}")


@pytest.mark.parametrize("k", [matrix(1), 3])
def test_request_reaching_max_model_len(setup, k):
    model_dir, prompts, _ = setup
    long_prompt = (prompts[0] * 40)[:90]
    batch = [long_prompt, prompts[1], prompts[2]]
    ref, ref_reasons, _ = _run(model_dir, batch, 200, None, max_model_len=100)
    got, reasons, _ = _run(model_dir, batch, 200, SpeculativeConfig(num_speculative_tokens=k), max_model_len=100)
    assert ref_reasons == ["max_model_len"] * 3
    assert len(ref[0]) == 10 and len(ref[1]) == 100 - len(prompts[1])
    assert_same_tokens(model_dir, batch, ref, got, f"max_model_len K={k}")
    assert reasons == ref_reasons


def test_seeded_random_sampling_is_reproducible(setup):
    model_dir, prompts, _ = setup
    eng = load_engine(model_dir, EngineConfig(max_model_len=256, max_num_seqs=4,
                                              speculative=SpeculativeConfig(num_speculative_tokens=2), graph=EAGER))
    params = SamplingParams(temperature=0.8, top_k=50, top_p=0.95)
    run = lambda seed: [o.token_ids for o in eng.generate(prompts[:4], params, 24, seed=seed)[0]]  # noqa: E731
    first = run(7)
    assert run(7) == first
    assert run(8) != first


def test_greedy_requests_beside_sampled_ones_give_no_specs_tokens(setup):
    """Requests as a client sends them, greedy and sampled in the same batches (top-k, top-p, per-request seeds,
    logprobs, as vLLM's keywords): every greedy request gives the no-spec run's tokens, and the sampled ones
    repeat with the run's seed. A keyword the engine does not serve (a per-request seed among them) is one error
    naming it."""
    model_dir, prompts, max_tokens = setup
    sampled = [{"temperature": 0.8, "top_k": 20}, {"temperature": 1.0, "top_p": 0.9},
               {"temperature": 0.7, "top_k": -1, "top_p": 0.8, "logprobs": 2}]
    params = [sampled[i // 3] if i % 3 == 2 and i // 3 < len(sampled) else
              ({"logprobs": 3} if i % 4 == 1 else {}) for i in range(len(prompts))]
    assert sum(p.get("temperature", 0) > 0 for p in params) == len(sampled)
    eng = load_engine(model_dir, EngineConfig(max_model_len=256, max_num_seqs=4,
                                              speculative=SpeculativeConfig(num_speculative_tokens=2), graph=EAGER))
    first, _, metrics = eng.generate(prompts, params, max_tokens, seed=11)
    second, _, _ = eng.generate(prompts, params, max_tokens, seed=11)
    reference, _, _ = _run(model_dir, prompts, max_tokens, None, max_num_seqs=4)
    greedy = [i for i, p in enumerate(params) if not p.get("temperature")]
    assert_same_tokens(model_dir, [prompts[i] for i in greedy], [reference[i] for i in greedy],
                       [first[i].token_ids for i in greedy], "greedy beside sampled")
    for i in greedy:
        if params[i].get("logprobs"):
            assert [max(lp, key=lp.get) for lp in first[i].logprobs] == first[i].token_ids
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    assert metrics.acceptance_rate > 0.3, metrics.as_dict()
    with pytest.raises(ValueError, match="'repetition_penalty' is not served by this engine; allowed: "
                                         "temperature, top_k, top_p, logprobs"):
        eng.generate(prompts[:1], {"temperature": 0.0, "repetition_penalty": 1.2}, 4)
    with pytest.raises(ValueError, match="'seed' is not served by this engine"):
        eng.generate(prompts[:1], {"temperature": 1.0, "seed": 3}, 4)
