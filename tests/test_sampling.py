import math

import pytest
import torch

from ascend_spec.sampling import (
    SamplingParams,
    SamplingTensors,
    apply_top_k_top_p,
    logits_to_probs,
    make_generator,
    sample,
    sample_from_probs,
)
from ascend_spec.sync_counter import HostSyncCounter

SIGNIFICANCE = 1e-3


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value (survival function via the regularised upper incomplete gamma)."""
    counts, probs = counts.double(), probs.double()
    expected = counts.sum() * probs / probs.sum()
    support = expected > 0
    assert counts[~support].sum() == 0, "samples outside the support"
    stat = ((counts[support] - expected[support]) ** 2 / expected[support]).sum()
    df = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


# The hand example: probabilities 0.1, 0.4, 0.2, 0.3.
P4 = torch.tensor([0.1, 0.4, 0.2, 0.3])
L4 = P4.log()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
    ],
)
def test_validation_names_field(kwargs, field):
    with pytest.raises(ValueError, match=field) as err:
        SamplingParams(**kwargs)
    assert ">=" in str(err.value) or "range" in str(err.value)


@pytest.mark.parametrize("seed", [3, -3])
def test_a_per_request_seed_is_refused_naming_the_runs_seed(seed):
    """One generator draws for a batch: a request's own seed would be silently dropped, so it is refused."""
    with pytest.raises(ValueError, match=rf"seed={seed}: per-request seeds are not served .*generate\(\.\.\., seed=N\)"
                                         r".*allowed: None"):
        SamplingParams(temperature=1.0, seed=seed)


def test_defaults_and_is_greedy():
    assert SamplingParams().is_greedy
    assert not SamplingParams(temperature=0.7).is_greedy
    p = SamplingParams(temperature=1.0, top_k=5, top_p=0.5)
    with pytest.raises(AttributeError):
        p.top_k = 3  # frozen


@pytest.mark.parametrize(
    "top_k, top_p, expected",
    [
        (0, 1.0, [0.1, 0.4, 0.2, 0.3]),
        (2, 1.0, [0, 4 / 7, 0, 3 / 7]),
        (1, 1.0, [0, 1, 0, 0]),
        (0, 0.6, [0, 4 / 7, 0, 3 / 7]),  # 0.4 < 0.6 <= 0.4 + 0.3
        (0, 0.4, [0, 1, 0, 0]),  # the top token alone reaches p
        (0, 0.75, [0, 4 / 9, 2 / 9, 3 / 9]),
        (3, 0.5, [0, 4 / 7, 0, 3 / 7]),  # after top-3: 4/9 < 0.5, add 3/9
        (3, 0.4, [0, 1, 0, 0]),  # after top-3: 4/9 >= 0.4
        (10, 1.0, [0.1, 0.4, 0.2, 0.3]),  # k > V means off
    ],
)
def test_top_k_top_p_hand_example(top_k, top_p, expected):
    st = SamplingTensors.from_params([SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)])
    probs = logits_to_probs(L4.unsqueeze(0), st)[0]
    torch.testing.assert_close(probs, torch.tensor(expected, dtype=torch.float32), atol=1e-6, rtol=0)


def test_per_row_parameters_in_one_batch():
    params = [
        SamplingParams(temperature=1.0, top_k=2),
        SamplingParams(temperature=1.0, top_p=0.4),
        SamplingParams(temperature=2.0),
        SamplingParams(),  # greedy row: temperature treated as 1
    ]
    st = SamplingTensors.from_params(params)
    probs = logits_to_probs(L4.expand(4, 4), st)
    torch.testing.assert_close(probs[0], torch.tensor([0, 4 / 7, 0, 3 / 7]), atol=1e-6, rtol=0)
    torch.testing.assert_close(probs[1], torch.tensor([0.0, 1, 0, 0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(probs[2], (L4 / 2).softmax(-1), atol=1e-6, rtol=0)
    torch.testing.assert_close(probs[3], P4, atol=1e-6, rtol=0)


def test_parameters_broadcast_over_positions():
    st = SamplingTensors.from_params([SamplingParams(1.0, top_k=1), SamplingParams(1.0)])
    logits = L4.expand(2, 3, 4)  # [B, K+1, V]
    probs = logits_to_probs(logits, st)
    assert probs.shape == (2, 3, 4)
    torch.testing.assert_close(probs[0], torch.tensor([0.0, 1, 0, 0]).expand(3, 4))
    torch.testing.assert_close(probs[1], P4.expand(3, 4), atol=1e-6, rtol=0)


def test_apply_top_k_top_p_returns_new_tensor():
    logits = L4.clone().unsqueeze(0)
    before = logits.clone()
    out = apply_top_k_top_p(logits, torch.tensor([1]), torch.tensor([0.9]))
    assert torch.equal(logits, before)
    assert torch.isinf(out).sum() == 3


def test_greedy_picks_argmax():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    st = SamplingTensors.from_params([SamplingParams()] * 3 + [SamplingParams(temperature=1.0)] * 3)
    ids = sample(logits, st, make_generator(0))
    assert ids.dtype == torch.int64
    assert torch.equal(ids[:3], logits[:3].argmax(-1))
    all_greedy = sample(logits, SamplingTensors.greedy_batch(6), None)
    assert torch.equal(all_greedy, logits.argmax(-1))


def test_sampling_is_sync_free():
    st = SamplingTensors.from_params([SamplingParams(0.8, top_k=3, top_p=0.9), SamplingParams()])
    logits = torch.randn(2, 3, 16)
    gen = make_generator(1)
    with HostSyncCounter() as sc:
        sample(logits, st, gen)
    assert sc.count == 0, sc.events


def test_exponential_race_matches_probs():
    probs = torch.tensor([0.05, 0.3, 0.0, 0.15, 0.1, 0.25, 0.02, 0.08, 0.05])
    n = 100_000
    ids = sample_from_probs(probs.expand(n, -1), make_generator(1234))
    counts = torch.bincount(ids, minlength=probs.numel())
    assert counts[2] == 0
    assert chi2_pvalue(counts, probs) > SIGNIFICANCE


def test_sample_with_temperature_matches_processed_probs():
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5, -0.5])
    n = 100_000
    st = SamplingTensors.from_params([SamplingParams(temperature=0.5, top_k=4)] * n)
    ids = sample(logits.expand(n, -1), st, make_generator(7))
    expected = (logits / 0.5).softmax(-1)
    expected[logits.argsort()[:2]] = 0  # top-4 of 6 drops the two lowest
    assert chi2_pvalue(torch.bincount(ids, minlength=6), expected) > SIGNIFICANCE


def test_chi2_helper_rejects_wrong_distribution():
    n = 100_000
    ids = sample_from_probs(torch.full((n, 4), 0.25), make_generator(3))
    counts = torch.bincount(ids, minlength=4)
    assert chi2_pvalue(counts, torch.tensor([0.25, 0.25, 0.25, 0.25])) > SIGNIFICANCE
    assert chi2_pvalue(counts, torch.tensor([0.26, 0.24, 0.25, 0.25])) < SIGNIFICANCE
    assert math.isclose(chi2_pvalue(torch.tensor([50, 50]), torch.tensor([0.5, 0.5])), 1.0)
