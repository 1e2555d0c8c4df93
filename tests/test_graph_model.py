"""graph/: config validation, weight loading errors, paged vs dense parity, cache writes, RoPE layout."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from ascend_spec.graph.paging import PagedInputs
from ascend_spec.graph.latent_cache import write_latent_cache
from ascend_spec.graph.config import ConfigError, ModelConfig
from ascend_spec.graph.layers import RotaryEmbedding
from ascend_spec.graph.steps import make_draft_step, make_target_step, slots_for
from ascend_spec.graph.weights import WeightLoadError, load_model

from .conftest import TINY, random_model


def _layout(n: int, blocks: list[int]):
    bt = torch.tensor([blocks])
    pos = torch.arange(n).view(1, -1)
    return bt, pos, slots_for(pos, bt, 16)


def test_non_deepseek_config_is_rejected():
    hf = TINY.to_hf_dict()
    hf["model_type"] = "llama"
    with pytest.raises(ConfigError, match="model_type='llama'"):
        ModelConfig.from_hf_dict(hf)


def test_roundtrip_load(tiny_ckpt):
    model = load_model(tiny_ckpt)
    ref = random_model()
    for (name, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("problem", ["missing", "unexpected", "shape"])
def test_weight_errors_name_the_tensor(tiny_ckpt, tmp_path, problem):
    tensors = load_file(str(tiny_ckpt / "model.safetensors"))
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    if problem == "missing":
        del tensors[name]
        expect = f"missing tensor '{name}'"
    elif problem == "unexpected":
        tensors["model.layers.9.mlp.up_proj.weight"] = torch.zeros(2, 2)
        expect = "unexpected tensor 'model.layers.9.mlp.up_proj.weight'"
    else:
        tensors[name] = torch.zeros(3, 512)
        expect = rf"shape mismatch for '{name}': expected \[64, 512\], found \[3, 512\]"
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(TINY.to_hf_dict()))
    with pytest.raises(WeightLoadError, match=expect):
        load_model(tmp_path)


def test_paged_matches_dense_prefill_and_decode():
    model = random_model()
    ids = torch.randint(1, TINY.vocab_size, (1, 37))
    bt, pos, slots = _layout(37, [3, 1, 4])
    with torch.no_grad():
        dense = model.target_dense(ids)
        caches = tuple(torch.zeros(6, 16, 576) for _ in range(2))
        step = make_target_step(model)
        prefill, _ = step(ids[:, :30], pos[:, :30], slots[:, :30], bt, torch.tensor([30]), caches)
        decoded = [step(ids[:, t:t + 1], pos[:, t:t + 1], slots[:, t:t + 1], bt, torch.tensor([t + 1]), caches)[0]
                   for t in range(30, 37)]
    torch.testing.assert_close(prefill, dense[:, :30], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat(decoded, 1), dense[:, 30:], atol=1e-4, rtol=1e-4)


def test_first_draft_matches_dense_mtp():
    """The paged draft's first step equals DeepSeek-V3's MTP on full sequences (h_t, token t+1 → t+2)."""
    model = random_model()
    ids = torch.randint(1, TINY.vocab_size, (1, 25))
    n = 20
    bt, pos, slots = _layout(n, [1, 2])
    with torch.no_grad():
        dense_h = model.target_dense(ids)
        mtp_logits = model.mtp_logits(model.mtp_dense(ids[:, 1:], dense_h[:, :-1]))
        caches = tuple(torch.zeros(4, 16, 576) for _ in range(2))
        hidden, _ = make_target_step(model)(ids[:, :n], pos, slots, bt, torch.tensor([n]), caches)
        draft_in = torch.cat([ids[:, 1:n], ids[:, n:n + 1]], 1)
        _, logits = make_draft_step(model, 2, 64)(draft_in, pos, hidden, torch.tensor([n - 1]), slots, bt,
                                                  torch.tensor([n]), torch.tensor([64]), torch.zeros(4, 16, 576))
    torch.testing.assert_close(logits[0, 0], mtp_logits[0, n - 1], atol=1e-4, rtol=1e-4)


def test_slot_minus_one_writes_nothing():
    cache = torch.randn(3, 16, 8)
    before = cache.clone()
    write_latent_cache(cache, torch.tensor([-1, 17, -1]), torch.ones(3, 6), torch.ones(3, 2))
    changed = (cache != before).any(-1).flatten().nonzero().flatten().tolist()
    assert changed == [17]
    assert torch.equal(cache.view(-1, 8)[17], torch.ones(8))


def test_draft_chain_writes_only_its_own_slots():
    """Every cache entry the draft chain writes is the slot of a position it drafts from: the verified tokens
    (its first step) and, per live row, the K - 1 chained drafts after the last accepted one; pad rows and
    everything else stay untouched. Slots are computed here by hand, not by ``slots_for``."""
    model = random_model()
    k, block = 3, 16
    table = torch.tensor([[1, 2], [3, 4], [0, 0]])
    pos = torch.tensor([[14, 15, 16], [5, 6, 7], [0, 0, 0]])
    sample_idx = torch.tensor([1, 2, 0])  # the last accepted position of each row: 15, 7 (row 2 is padding)
    seq_lens = torch.tensor([17, 8, 0])

    def slot(row: int, p: int) -> int:
        return int(table[row, p // block]) * block + p % block

    slots = torch.tensor([[slot(0, p) for p in (14, 15, 16)], [slot(1, p) for p in (5, 6, 7)], [-1, -1, -1]])
    ids = torch.randint(1, TINY.vocab_size, (3, 3))
    hidden = torch.randn(3, 3, TINY.hidden_size)
    cache = torch.randn(6, block, 576)
    before = cache.clone()
    with torch.no_grad():
        make_draft_step(model, k, 64)(ids, pos, hidden, sample_idx, slots, table, seq_lens,
                                      torch.full_like(seq_lens, 64), cache)
    written = set((cache != before).any(-1).flatten().nonzero().flatten().tolist())
    chained = {slot(0, 15 + j) for j in range(1, k)} | {slot(1, 7 + j) for j in range(1, k)}
    assert written == set(slots[:2].flatten().tolist()) | chained, (sorted(written), sorted(chained))


def test_a_k_0_draft_writes_the_verified_tokens_cache_entries_as_the_chain_first_step_does_and_samples_none():
    """K = 0, the draft of a step whose scheduler asked for no drafts (vLLM's per-batch-size K): the MTP layer's
    cache entries of the verified tokens, the very values K = 2's first step writes, nothing else, no draft."""
    model = random_model()
    block = 16
    table = torch.tensor([[1, 2], [3, 4], [0, 0]])
    pos = torch.tensor([[15], [7], [0]])
    slots = torch.tensor([[1 * block + 15], [3 * block + 7], [-1]])
    ids = torch.randint(1, TINY.vocab_size, (3, 1))
    hidden = torch.randn(3, 1, TINY.hidden_size)
    seq_lens, sample_idx = torch.tensor([16, 8, 0]), torch.zeros(3, dtype=torch.long)
    start = torch.randn(6, block, 576)
    caches = {k: start.clone() for k in (0, 2)}
    with torch.no_grad():
        drafts = {k: make_draft_step(model, k, 64)(ids, pos, hidden, sample_idx, slots, table, seq_lens,
                                                   torch.full_like(seq_lens, 64), caches[k])[0] for k in (0, 2)}
    assert drafts[0].shape == (3, 0) and drafts[2].shape == (3, 2)
    written = set((caches[0] != start).any(-1).flatten().nonzero().flatten().tolist())
    assert written == {1 * block + 15, 3 * block + 7}
    for s in written:
        assert torch.equal(caches[0].view(-1, 576)[s], caches[2].view(-1, 576)[s])


def test_pad_rows_are_finite_and_inert():
    model = random_model()
    caches = tuple(torch.zeros(4, 16, 576) for _ in range(2))
    ids = torch.zeros(2, 3, dtype=torch.long)
    ids[0] = torch.tensor([5, 6, 7])
    bt = torch.tensor([[1, 2], [0, 0]])
    pos = torch.tensor([[0, 1, 2], [0, 0, 0]])
    slots = torch.tensor([[16, 17, 18], [-1, -1, -1]])
    with torch.no_grad():
        hidden, logits = make_target_step(model)(ids, pos, slots, bt, torch.tensor([3, 0]), caches)
    assert torch.isfinite(logits).all()
    assert torch.equal(caches[0][0], torch.zeros(16, 576)), "pad rows wrote into the null block"


def test_rope_is_interleaved_gptj_style():
    rope = RotaryEmbedding(4, 16, 10000.0)
    x = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])
    out = rope(x, torch.tensor([3]))
    f0, f1 = 3 * 1.0, 3 * 10000 ** (-0.5)
    import math
    expect = [1 * math.cos(f0) - 2 * math.sin(f0), 2 * math.cos(f0) + 1 * math.sin(f0),
              3 * math.cos(f1) - 4 * math.sin(f1), 4 * math.cos(f1) + 3 * math.sin(f1)]
    torch.testing.assert_close(out.flatten(), torch.tensor(expect), atol=1e-5, rtol=1e-5)


@pytest.mark.vllm
def test_rope_matches_vllm_deepseek_rope():
    rotary = pytest.importorskip("vllm.model_executor.layers.rotary_embedding")
    from vllm.config import VllmConfig, set_current_vllm_config

    ours = RotaryEmbedding(64, 128, 10000.0)
    with set_current_vllm_config(VllmConfig()):
        # DeepSeek's attention in vLLM builds its rope with is_neox_style=False when rope_scaling is null.
        theirs = rotary.get_rope(64, max_position=128, is_neox_style=False,
                                 rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    pos = torch.arange(0, 100, 7)
    q = torch.randn(len(pos), 2, 64)
    k = torch.randn(len(pos), 1, 64)
    q_ref, k_ref = theirs.forward_native(pos, q.clone().flatten(1), k.clone().flatten(1))
    torch.testing.assert_close(ours(q, pos).flatten(1), q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours(k, pos).flatten(1), k_ref, atol=1e-5, rtol=1e-5)


def test_weight_left_linear_is_the_same_function_and_backends_choose_it():
    """``(W·xᵀ)ᵀ`` (MKL's faster kernel for a few tokens on CPU) equals ``x·Wᵀ``; CPU inductor turns it on for every
    linear layer of the model, the eager reference keeps the plain product."""
    from ascend_spec.graph.backends.eager import EagerBackend
    from ascend_spec.graph.backends.inductor import InductorBackend
    from ascend_spec.graph.layers import Linear

    torch.manual_seed(0)
    lin = Linear(16, 24, bias=False)
    for shape in [(2, 3, 16), (1, 1, 16)]:  # a lone token takes the padded path
        x = torch.randn(*shape)
        lin.weight_left = False
        plain = lin(x)
        lin.weight_left = True
        left = lin(x)
        assert left.shape == plain.shape == (*shape[:-1], 24)
        torch.testing.assert_close(left, plain, rtol=1e-5, atol=1e-6)
    model = random_model()
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and model.lm_head in linears
    model.use_backend(InductorBackend(torch.device("cpu")))
    assert all(m.weight_left for m in linears)
    model.use_backend(EagerBackend())
    assert not any(m.weight_left for m in linears)


def test_compiled_few_row_products_are_row_reductions_that_do_not_depend_on_the_other_rows():
    """A compiled product whose row count the shapes fix (at most ``ROW_REDUCTION_MAX_ROWS``) is one reduction per
    row: the same function as ``x·Wᵀ``, and a row's result is bit for bit the same alone or beside another row, so a
    lone request's verify and its one-token step give a token the same logits. A dynamic row count keeps MKL, and
    the choice does not specialise it."""
    from ascend_spec.graph.layers import ROW_REDUCTION_MAX_ROWS, Linear

    torch.manual_seed(0)
    lin = Linear(256, 384, bias=False)
    lin.weight_left = True
    traced: list[str] = []

    def product(x: torch.Tensor) -> torch.Tensor:
        return lin(x)

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        traced.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        from torch._inductor.compile_fx import compile_fx
        return compile_fx(gm, example_inputs)

    compiled = torch.compile(product, backend=backend, fullgraph=True, dynamic=False)
    pair = torch.randn(1, ROW_REDUCTION_MAX_ROWS, 256)
    with torch.no_grad():
        both, alone = compiled(pair), compiled(pair[:, :1].clone())
    torch.testing.assert_close(both, torch.nn.functional.linear(pair, lin.weight), rtol=1e-5, atol=1e-5)
    assert torch.equal(both[:, :1], alone)
    assert not any("mm" in t for t in traced), traced  # no MKL product in the fixed-row graphs
    traced.clear()
    many = torch.randn(2, 1, 256)  # two rows, but a dynamic count: kept dynamic (mark_dynamic fails otherwise)
    torch._dynamo.mark_dynamic(many, 0)
    dynamic = torch.compile(product, backend=backend, fullgraph=True, dynamic=None)
    with torch.no_grad():
        torch.testing.assert_close(dynamic(many), torch.nn.functional.linear(many, lin.weight), rtol=1e-5,
                                   atol=1e-5)
    assert any("mm" in t for t in traced), traced


def test_opaque_external_runs_at_each_call_and_never_recompiles():
    """An opaque External (vLLM's MoE inside our graph) is called, not traced: state it reads at run time (vLLM's
    per-step forward context) changes without a recompile, and its output reaches the graph."""
    from ascend_spec.engine import dynamo_compile_count
    from ascend_spec.graph.external import External

    state = {"scale": 1.0}
    ext = External(lambda x: x * state["scale"], "scaler", opaque=True)
    fn = torch.compile(lambda x: ext(x + 1) * 2, fullgraph=True, dynamic=True)
    x = torch.ones(3)
    assert torch.equal(fn(x), (x + 1) * 2)
    before = dynamo_compile_count()
    for scale in (2.0, 3.0):
        state["scale"] = scale  # a traced call would bake the value in, or guard on it and recompile
        assert torch.equal(fn(x), (x + 1) * scale * 2)
    assert dynamo_compile_count() == before
    assert "opaque" in repr(ext)


def test_opaque_external_does_not_keep_its_host_layer_alive():
    """The op's registry holds opaque Externals weakly: a torn-down engine's host layers (vLLM's MoE) are freed."""
    import gc
    import weakref

    from ascend_spec.graph.external import External

    host = torch.nn.Linear(4, 4)
    alive = weakref.ref(host)
    ext = External(lambda x: host(x), "host", opaque=True)
    assert ext(torch.ones(2, 4)).shape == (2, 4)
    del ext, host
    gc.collect()
    assert alive() is None


def test_an_engine_built_after_another_was_freed_calls_its_externals_by_the_same_numbers():
    """A freed External's slot is taken by the next one (its graphs, saved whole with these numbers, load); one
    still alive keeps its own."""
    import gc

    from ascend_spec.graph.external import External

    first = External(lambda x: x + 1, "first", opaque=True)
    index = first.index
    kept = External(lambda x: x + 2, "kept", opaque=True)
    del first
    gc.collect()
    again = External(lambda x: x + 3, "again", opaque=True)
    assert again.index == index and kept.index != index
    assert torch.equal(again(torch.zeros(2)), torch.full((2,), 3.0))
    assert torch.equal(kept(torch.zeros(2)), torch.full((2,), 2.0))
