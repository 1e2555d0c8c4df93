"""Statistical checks that speculative sampling leaves the target distribution unchanged.

One call verifies a batch of N identical requests, so each column of the output is N samples. Seeds are fixed, so
the tests are deterministic; the significance level is 1e-3.
"""
import pytest
import torch

from ascend_spec.sampling import SamplingParams, SamplingTensors, make_generator
from ascend_spec.spec_decode import rejection_sample

SIGNIFICANCE = 1e-3
N = 100_000
V = 12
K = 2


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value (survival function via the regularised upper incomplete gamma)."""
    counts, probs = counts.double(), probs.double()
    expected = counts.sum() * probs / probs.sum()
    support = expected > 0
    assert counts[~support].sum() == 0, f"samples outside the support: {counts.tolist()} vs {probs.tolist()}"
    stat = ((counts[support] - expected[support]) ** 2 / expected[support]).sum()
    df = int(support.sum()) - 1
    if df == 0:
        return 1.0  # one possible outcome, and every sample hit it
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def assert_distributed_as(tokens: torch.Tensor, probs: torch.Tensor, min_samples: int = 1000) -> None:
    assert tokens.numel() >= min_samples, f"only {tokens.numel()} samples"
    assert ((tokens >= 0) & (tokens < V)).all()
    counts = torch.bincount(tokens.long(), minlength=V)
    pval = chi2_pvalue(counts, probs)
    assert pval > SIGNIFICANCE, f"p-value {pval:.2e}; counts {counts.tolist()}, expected probs {probs.tolist()}"


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Processed target distribution, written independently of ascend_spec.sampling (float64, plain loops)."""
    probs = (logits.double() / temperature).softmax(-1)
    order = probs.argsort(descending=True).tolist()
    keep = order[:top_k] if top_k else order
    mass = sum(probs[i].item() for i in keep)
    kept, cum = [], 0.0
    for i in keep:  # smallest prefix whose renormalised mass reaches top_p
        kept.append(i)
        cum += probs[i].item() / mass
        if cum >= top_p:
            break
    out = torch.zeros_like(probs)
    out[kept] = probs[kept]
    return out / out.sum()


def setup(seed: int):
    """Target logits per position [K+1, V], draft distributions [K, V], drafts [N, K] sampled from them."""
    gen = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(K + 1, V, generator=gen)
    q = (target_logits[:K] + torch.randn(K, V, generator=gen)).softmax(-1)  # related to p but different
    drafts = torch.stack([torch.multinomial(q[j], N, replacement=True, generator=gen) for j in range(K)], 1)
    return target_logits, q, drafts.to(torch.int32)


def run(target_logits, drafts, q=None, params=None, num_draft=K, seed=0):
    logits = target_logits.expand(N, K + 1, V)
    draft_probs = None if q is None else q.expand(N, K, V)
    nd = torch.full((N,), num_draft, dtype=torch.int32)
    return rejection_sample(drafts, nd, logits, params, draft_probs, make_generator(seed))


def check_chain(out, drafts, p, num_draft=K):
    """Column 0 ~ p0; column j given drafts 0..j-1 accepted ~ p_j (the bonus at j == num_draft)."""
    accepted = torch.ones(N, dtype=torch.bool)
    for j in range(num_draft + 1):
        assert_distributed_as(out[accepted, j], p[j])
        if j < num_draft:
            # A rejected draft x has residual(x) = 0, so "emitted == draft" is exactly "accepted".
            accepted = accepted & (out[:, j] == drafts[:, j])
    assert (out[:, num_draft + 1:] == -1).all()


PLAIN = SamplingParams(temperature=1.0)
PROCESSED = SamplingParams(temperature=1.5, top_k=8, top_p=0.85)


def target_probs(target_logits, sp: SamplingParams) -> torch.Tensor:
    return torch.stack([reference_probs(row, sp.temperature, sp.top_k, sp.top_p) for row in target_logits])


@pytest.mark.parametrize("sp", [PLAIN, PROCESSED], ids=["plain", "temp_topk_topp"])
def test_one_hot_drafts_preserve_target(sp):
    # draft_probs=None: each draft is treated as deterministic (q one-hot); drafts still vary across requests.
    target_logits, _, drafts = setup(seed=11)
    out = run(target_logits, drafts, None, SamplingTensors.from_params([sp] * N), seed=1)
    check_chain(out, drafts, target_probs(target_logits, sp))


@pytest.mark.parametrize("sp", [PLAIN, PROCESSED], ids=["plain", "temp_topk_topp"])
def test_general_draft_distribution_preserves_target(sp):
    target_logits, q, drafts = setup(seed=12)
    out = run(target_logits, drafts, q, SamplingTensors.from_params([sp] * N), seed=2)
    check_chain(out, drafts, target_probs(target_logits, sp))


@pytest.mark.parametrize("num_draft", [0, 1])
def test_partial_num_draft_preserves_target(num_draft):
    target_logits, q, drafts = setup(seed=13)
    drafts = torch.where(torch.arange(K) < num_draft, drafts, -1)
    out = run(target_logits, drafts, q, [PLAIN] * N, num_draft=num_draft, seed=3)
    check_chain(out, drafts, target_probs(target_logits, PLAIN), num_draft=num_draft)


def test_identical_draft_and_target_always_accept():
    target_logits, _, _ = setup(seed=14)
    p = target_logits.softmax(-1)
    gen = torch.Generator().manual_seed(0)
    drafts = torch.stack([torch.multinomial(p[j], 1000, replacement=True, generator=gen) for j in range(K)], 1)
    logits = target_logits.expand(1000, K + 1, V)
    out = rejection_sample(drafts, torch.full((1000,), K), logits, [PLAIN] * 1000, p[:K].expand(1000, K, V),
                           make_generator(0))
    assert torch.equal(out[:, :K], drafts.to(torch.int32))
    assert (out[:, K] >= 0).all()


def test_seeded_runs_reproducible_and_seeds_differ():
    target_logits, q, drafts = setup(seed=15)
    b = 2000
    args = (drafts[:b], torch.full((b,), K), target_logits.expand(b, K + 1, V),
            SamplingTensors.from_params([PROCESSED] * b), q.expand(b, K, V))
    first = rejection_sample(*args, generator=make_generator(123))
    again = rejection_sample(*args, generator=make_generator(123))
    other = rejection_sample(*args, generator=make_generator(124))
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
