"""The MoE + YaRN checkpoint in graph mode: draft chain vs dense MTP, speculation exactness, eager vs inductor,
zero recompiles over ≥ 1,000 steps and zero host syncs in the padded path."""
import random

import pytest
import torch

from ascend_spec.config import EngineConfig, SpeculativeConfig, GraphModeConfig
from ascend_spec.engine import load_engine
from ascend_spec.graph.steps import make_draft_step, make_target_step, slots_for
from ascend_spec.graph.weights import load_model
from ascend_spec.sampling import SamplingParams

from .conftest import generate_without_recompiles, matrix

#: every test here builds compiled engines or graphs (make test-fast leaves them out)
pytestmark = pytest.mark.slow

# The bundled trained model made MoE + YaRN (dense layer 0, MoE layer 1 and MoE MTP layer): drafts get accepted.
PRESET = "bundled-moe"
COMPILED_SIZES = (2, 4)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 2048) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def _engine(path, k: int | None, backend: str, count_host_syncs: bool = False):
    spec = SpeculativeConfig(num_speculative_tokens=k) if k else None
    # compiled: lone requests pad to two rows (one-row graphs: test_fused_step's lone-request test)
    graph = (GraphModeConfig(enabled=False, backend="eager") if backend == "eager"
             else GraphModeConfig(backend=backend, graph_batch_sizes=COMPILED_SIZES))
    return load_engine(path, EngineConfig(max_model_len=256, max_num_seqs=4, speculative=spec, graph=graph,
                                          adaptive_k=False),
                       count_host_syncs=count_host_syncs)


def test_first_draft_matches_dense_mtp(moe_ckpts):
    """The paged MoE draft's first step equals the MTP layer on full sequences (h_t, token t+1 → t+2)."""
    model = load_model(moe_ckpts[PRESET])
    ids = torch.randint(1, 2048, (1, 40), generator=torch.Generator().manual_seed(0))
    n = 33
    bt = torch.tensor([[1, 2, 3]])
    pos = torch.arange(n).view(1, -1)
    slots = slots_for(pos, bt, 16)
    with torch.no_grad():
        dense_h = model.target_dense(ids)
        ref = model.mtp_logits(model.mtp_dense(ids[:, 1:], dense_h[:, :-1]))
        caches = tuple(torch.zeros(4, 16, 576) for _ in range(model.cfg.num_hidden_layers))
        hidden, _ = make_target_step(model)(ids[:, :n], pos, slots, bt, torch.tensor([n]), caches)
        draft_in = torch.cat([ids[:, 1:n], ids[:, n:n + 1]], 1)
        _, logits = make_draft_step(model, 2, 256)(draft_in, pos, hidden, torch.tensor([n - 1]), slots, bt,
                                                   torch.tensor([n]), torch.tensor([256]), torch.zeros(4, 16, 576))
    torch.testing.assert_close(logits[0, 0], ref[0, n - 1], atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def no_spec_reference(moe_ckpts):
    eng = _engine(moe_ckpts[PRESET], None, "eager")
    return [o.token_ids for o in eng.generate(_prompts(6), SamplingParams(), [20, 33, 7, 41, 28, 16])[0]]


@pytest.mark.parametrize("k", [matrix(1), 2])
def test_greedy_spec_equals_no_spec_and_is_sync_free(moe_ckpts, no_spec_reference, k):
    eng = _engine(moe_ckpts[PRESET], k, "eager", count_host_syncs=True)
    outs, stats, metrics = eng.generate(_prompts(6), SamplingParams(), [20, 33, 7, 41, 28, 16])
    assert [o.token_ids for o in outs] == no_spec_reference
    # Eager runs count every op of the padded path (target verify, rejection sampling, MoE draft chain).
    assert stats.host_syncs == 0, stats.host_sync_events[:10]
    assert metrics.acceptance_rate > 0.3, metrics.as_dict()


@pytest.fixture(scope="module")
def inductor_engine(moe_ckpts):
    """Over 90 s (its first test's setup): the MoE engine's whole graph set compiled, the only compile of our MoE
    draft chain and fused step with inductor in make test."""
    eng = _engine(moe_ckpts[PRESET], 2, "inductor")
    eng.warmup(progress=False)
    return eng


def test_inductor_equals_eager(moe_ckpts, no_spec_reference, inductor_engine):
    eager = _engine(moe_ckpts[PRESET], 2, "eager")
    ref, _, ref_m = eager.generate(_prompts(6), SamplingParams(), [20, 33, 7, 41, 28, 16])
    got, stats, m = inductor_engine.generate(_prompts(6), SamplingParams(), [20, 33, 7, 41, 28, 16])
    assert [o.token_ids for o in got] == [o.token_ids for o in ref] == no_spec_reference
    assert m.as_dict() == ref_m.as_dict()
    assert stats.recompiles_after_warmup == 0


def test_zero_recompiles_over_1000_steps(inductor_engine):
    rng = random.Random(1)
    prompts = _prompts(300, seed=2)  # drafts get accepted: ~1,400 steps for ~11,000 tokens
    max_tokens = [rng.randint(1, 70) for _ in prompts]
    stats, seen = generate_without_recompiles(inductor_engine, prompts, max_tokens)
    assert stats.num_steps >= 1000, stats.num_steps
    assert seen == {1, 2, 3, 4}
    assert stats.recompiles_after_warmup == 0


@pytest.mark.xfail(strict=True, reason="inductor (torch 2.13, CPU) miscompiles the MTP chain's second step when the "
                   "attention and shared-expert products are weight-left; graph.model.use_backend keeps MoE models on "
                   "the plain product until this passes")
def test_weight_left_moe_draft_chain_compiles_right(moe_ckpts):
    from ascend_spec.graph.layers import Linear

    model = load_model(moe_ckpts[PRESET])
    for m in model.modules():
        if isinstance(m, Linear):
            m.weight_left = True
    cfg = model.cfg
    torch.manual_seed(0)
    b, q = 4, 3
    cache = torch.randn(64, 16, cfg.latent_dim) * 0.1
    table = torch.arange(b * 4).view(b, 4) + 1
    pos = 30 + torch.arange(q).expand(b, q).clone()
    args = (torch.randint(1, cfg.vocab_size, (b, q)), pos, torch.randn(b, q, cfg.hidden_size),
            torch.tensor([0, 1, 2, 1]), slots_for(pos, table, 16), table, pos[:, -1] + 1, torch.full((b,), 256))
    fn = make_draft_step(model, 2, 256)
    with torch.no_grad():
        _, eager = fn(*args, cache.clone())
        _, compiled = torch.compile(fn, fullgraph=True, dynamic=False)(*args, cache.clone())
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
