"""The DSA family (DeepSeek-V3.2, GLM-5.x: MLA + DeepSeek Sparse Attention) in graph/: HF parity, its config's
errors, its caches, and greedy speculative == no-spec through the engine. ``index_topk`` (16) is below every
context here, so the indexer's choice changes what attention reads."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from ascend_spec.config import EngineConfig, GraphModeConfig, SpeculativeConfig
from ascend_spec.engine import load_engine
from ascend_spec.graph.checkpoint import WeightLoadError
from ascend_spec.graph.config import ConfigError
from ascend_spec.graph.dsa.config import DsaConfig
from ascend_spec.graph.dsa.indexer import NO_TOKEN, top_positions
from ascend_spec.graph.dsa.sparse_kernels import gather_sparse_mla
from ascend_spec.graph.families import config_from_hf
from ascend_spec.graph.mla_kernels import gather_mla
from ascend_spec.graph.paging import PagedInputs
from ascend_spec.graph.steps import make_target_step, slots_for
from ascend_spec.graph.weights import load_model
from ascend_spec.sampling import SamplingParams
from ascend_spec_tools.tiny_models import DSA_PRESETS

from .conftest import matrix

EAGER = GraphModeConfig(enabled=False, backend="eager")
BLOCK = 16


def _paged_logits(model, ids: torch.Tensor, layout: str = "pair") -> torch.Tensor:
    """Prefill all but the last 6 tokens, then decode them one by one (both paths of the paged caches)."""
    n = ids.shape[1]
    blocks = -(-n // BLOCK)
    table = torch.arange(1, blocks + 1).view(1, -1)
    pos = torch.arange(n).view(1, -1)
    caches = tuple(model.cfg.layer_cache(layout, blocks + 1, BLOCK, torch.float32, "cpu")
                   for _ in range(model.cfg.num_hidden_layers))
    step = make_target_step(model)
    cut = n - 6
    _, head = step(ids[:, :cut], pos[:, :cut], slots_for(pos[:, :cut], table, BLOCK), table, torch.tensor([cut]),
                   caches)
    tail = [step(ids[:, t:t + 1], pos[:, t:t + 1], slots_for(pos[:, t:t + 1], table, BLOCK), table,
                 torch.tensor([t + 1]), caches)[1] for t in range(cut, n)]
    return torch.cat([head, *tail], dim=1)


@pytest.mark.parametrize("preset", sorted(DSA_PRESETS))
def test_target_logits_match_hf_fp32(dsa_ckpts, preset):
    """Ours (paged, both cache layouts, and dense) against transformers' DeepseekV32ForCausalLM /
    GlmMoeDsaForCausalLM, fp32, 60 tokens with top-k 16; and the selection matters: the same weights with top-k
    past the context (dense attention) are far from HF's."""
    from transformers import AutoModelForCausalLM

    path = dsa_ckpts[(preset, "random")]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_model(path)
    ids = torch.randint(1, 2048, (1, 60), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        diffs = {"paged pair": (_paged_logits(ours, ids, "pair") - ref).abs().max().item(),
                 "paged single": (_paged_logits(ours, ids, "single") - ref).abs().max().item(),
                 "dense": (ours.logits(ours.target_dense(ids)) - ref).abs().max().item()}
        ours.cfg = dataclasses.replace(ours.cfg, indexer=dataclasses.replace(ours.cfg.indexer, topk=4096))
        for layer in ours.model.layers:
            if layer.self_attn.indexer is not None:
                layer.self_attn.indexer.topk = 4096
        dense_attention = (ours.logits(ours.target_dense(ids)) - ref).abs().max().item()
    print(f"{preset}: max |logit diff| vs HF {diffs}; with top-k past the context {dense_attention:.3f} "
          f"(logit scale {ref.abs().max():.2f})")
    assert max(diffs.values()) < 1e-4
    assert dense_attention > 1e-2


def test_sparse_attention_over_every_visible_token_is_mla():
    """With every visible token selected, the sparse kernel computes the dense reference kernel's function; with
    fewer visible tokens than top-k the rest are ``NO_TOKEN``; a pad row (nothing visible) stays finite."""
    gen = torch.Generator().manual_seed(0)
    b, q, h, c, r, blocks = 3, 2, 4, 32, 8, 6
    kv_c, kv_pe = torch.randn(blocks, BLOCK, c, generator=gen), torch.randn(blocks, BLOCK, r, generator=gen)
    table = torch.tensor([[1, 2, 3], [4, 5, 0], [0, 0, 0]])
    seq_lens = torch.tensor([40, 20, 0])
    positions = torch.stack([seq_lens - q + i for i in range(q)], dim=1).clamp(min=0)
    inp = PagedInputs(positions, positions, table, seq_lens)
    q_lat, q_pe = torch.randn(b, q, h, c, generator=gen), torch.randn(b, q, h, r, generator=gen)
    width = table.shape[1] * BLOCK
    key_pos = torch.arange(width)
    visible = (key_pos <= positions.unsqueeze(-1)) & (key_pos < seq_lens.view(-1, 1, 1))
    selected = top_positions(torch.randn(b, q, width, generator=gen), visible, topk=64)
    assert (selected[1] != NO_TOKEN).sum(-1).tolist() == [19, 20] and (selected[2] == NO_TOKEN).all()
    got = gather_sparse_mla(q_lat, q_pe, (kv_c, kv_pe), inp, selected, 0.1)
    ref = gather_mla(q_lat, q_pe, (kv_c, kv_pe), inp, 0.1)
    torch.testing.assert_close(got[:2], ref[:2], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(got).all()


def test_ties_go_to_the_earlier_position_whatever_the_width():
    scores = torch.tensor([[[0.0, 2.0, 0.0, 0.0, 1.0, 0.0]]])
    visible = torch.ones_like(scores, dtype=torch.bool)
    assert top_positions(scores, visible, 3).tolist() == [[[1, 4, 0]]]
    wider = torch.cat([scores, torch.zeros(1, 1, 30)], dim=-1)
    assert top_positions(wider, torch.ones_like(wider, dtype=torch.bool), 3).tolist() == [[[1, 4, 0]]]


def test_the_cache_is_the_latent_then_the_index_keys():
    cfg = DSA_PRESETS["glm5-shared-topk"]
    pair = cfg.layer_cache("pair", 5, 128, torch.bfloat16, "cpu")
    assert [tuple(t.shape) for t in pair] == [(5, 128, cfg.kv_lora_rank), (5, 128, cfg.qk_rope_head_dim),
                                              (5, 128, cfg.indexer.head_dim)]
    single = cfg.layer_cache("single", 5, 16, torch.float32, "cpu")
    assert [tuple(t.shape) for t in single] == [(5, 16, cfg.latent_dim), (5, 16, cfg.indexer.head_dim)]


def _hf(**changes) -> dict:
    hf = DSA_PRESETS["glm5-shared-topk"].to_hf_dict()
    for key, value in changes.items():
        if value is None:
            hf.pop(key, None)
        else:
            hf[key] = value
    return hf


@pytest.mark.parametrize("changes,message", [
    ({"index_topk": 0}, r"index_topk=0; allowed: an integer >= 1"),
    ({"index_topk": -2048}, r"index_topk=-2048; allowed: an integer >= 1"),
    ({"index_n_heads": "8"}, r"index_n_heads='8'; allowed: an integer >= 1"),
    ({"indexer_types": ["full", "sparse", "full"]}, r"indexer_types has 'sparse'; allowed: \['full', 'shared'\]"),
    ({"indexer_types": ["shared", "full", "full"]}, r"indexer_types\[0\]='shared'; allowed: 'full'"),
    ({"indexer_types": ["full", "full"]}, r"indexer_types has 2 entries for num_hidden_layers=3"),
    ({"indexer_types": None, "index_topk_pattern": "FXF"}, r"index_topk_pattern has 'X'; allowed letters"),
    ({"index_head_dim": None}, r"missing required key 'index_head_dim'"),
    ({"index_head_dim": 8}, r"index_head_dim=8 < qk_rope_head_dim=16"),
    ({"q_lora_rank": None}, r"q_lora_rank is null"),
    ({"mlp_layer_types": ["sparse", "sparse", "sparse"]}, r"mlp_layer_types=.* disagrees with first_k_dense_replace"),
    ({"model_type": "deepseek_v4"}, r"model_type='deepseek_v4' is not a family we draft; allowed: \['deepseek_v3', "
                                    r"'deepseek_v32', 'glm_moe_dsa'\]"),
])
def test_bad_dsa_configs_give_one_clear_error(changes, message):
    with pytest.raises(ConfigError, match=message):
        config_from_hf(_hf(**changes))


def _vllm_config(hf: dict):
    from types import SimpleNamespace

    return SimpleNamespace(speculative_config=SimpleNamespace(draft_model_config=SimpleNamespace(
        hf_config=SimpleNamespace(to_dict=lambda: dict(hf)))))


@pytest.mark.parametrize("model_type", ["glm_moe_dsa", "deepseek_v32"])
def test_inside_vllm_the_draft_config_is_read_by_its_family(model_type):
    """vLLM hands every DeepSeek-style draft over renamed to ``deepseek_mtp`` (its config class keeps the model's
    own type): a DSA model is read by its family, indexer included, never as DeepSeek-V3 without it."""
    from ascend_spec.compat.host_weights import config_from_vllm

    cfg = config_from_vllm(_vllm_config({**_hf(), "model_type": model_type, "architectures": ["DeepSeekMTPModel"]}))
    assert isinstance(cfg, DsaConfig) and cfg.model_type == model_type and cfg.sparse_attention() is not None


def test_inside_vllm_a_family_we_do_not_draft_is_one_error():
    from ascend_spec.compat.host_weights import config_from_vllm
    from ascend_spec.compat.shims import CompatError

    with pytest.raises(CompatError, match=r"model_type='deepseek_v4' is not a family we draft; allowed: "
                                          r"\['deepseek_v3', .*'deepseek_v32', 'glm_moe_dsa'\]"):
        config_from_vllm(_vllm_config({**_hf(), "model_type": "deepseek_v4"}))


def test_inside_vllm_itself_a_dsa_draft_is_one_error_at_start():
    """vLLM's own indexer cache holds fp8 keys packed with their scales: its V1 and V2 adapters refuse a DSA
    draft at load; vllm-ascend's (whose SFA cache keeps keys in the model dtype) draft it."""
    from ascend_spec.compat import ascend, ascend_v2, draft_core, drafter, speculator_v2
    from ascend_spec.compat.shims import CompatError
    from ascend_spec.graph.config import ModelConfig

    dsa = config_from_hf({**_hf(), "model_type": "glm_moe_dsa"})
    with pytest.raises(CompatError, match=r"model_type='glm_moe_dsa': inside vLLM the draft layer's indexer keys "
                                          r"are fp8.*enabled: false"):
        draft_core.refuse_unreadable_sparse_cache(dsa, readable=False)
    draft_core.refuse_unreadable_sparse_cache(dsa, readable=True)
    v3 = ModelConfig.from_hf_dict({**_hf(), "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]})
    draft_core.refuse_unreadable_sparse_cache(v3, readable=False)  # DeepSeek-V3: no indexer cache
    assert draft_core.DraftCoreMixin._sparse_cache_readable is False
    assert not drafter.AscendSpecMtpMixin._sparse_cache_readable
    assert not speculator_v2.AscendSpecV2Mixin._sparse_cache_readable
    assert ascend.AscendSpecNpuMixin._sparse_cache_readable and ascend_v2.AscendSpecNpuV2Mixin._sparse_cache_readable


def test_indexer_layer_types_follow_transformers_and_vllm():
    """``index_topk_pattern`` letters, and ``index_topk_freq`` / ``index_skip_topk_offset`` (the rule vLLM's
    ``attention.py`` and transformers share); every layer full without either."""
    base = _hf(indexer_types=None, num_hidden_layers=5, mlp_layer_types=None)
    assert config_from_hf({**base, "index_topk_pattern": "FSSFF"}).indexer.layer_types == (
        "full", "shared", "shared", "full", "full")
    # offset 2 (the default): layers 0 and 1 full, then every second
    assert config_from_hf({**base, "index_topk_freq": 2}).indexer.layer_types == (
        "full", "full", "shared", "full", "shared")
    assert config_from_hf(base).indexer.layer_types == ("full",) * 5
    assert isinstance(config_from_hf(base), DsaConfig)


def test_missing_indexer_weights_are_named(dsa_ckpts, tmp_path):
    src = dsa_ckpts[("v32-half-rope", "random")]
    tensors = load_file(src / "model.safetensors")
    dropped = "model.layers.3.self_attn.indexer.wk.weight"  # the MTP layer's own indexer
    del tensors[dropped]
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(WeightLoadError, match=rf"missing tensor '{dropped}'"):
        load_model(tmp_path)


def _greedy(path, k, max_num_seqs=4):
    spec = SpeculativeConfig(num_speculative_tokens=k) if k else None
    eng = load_engine(path, EngineConfig(max_model_len=128, max_num_seqs=max_num_seqs, speculative=spec, graph=EAGER,
                                         adaptive_k=False))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 2048, (n,), generator=gen).tolist() for n in (40, 23, 7, 55)]
    outs, _, metrics = eng.generate(prompts, SamplingParams(), [30, 25, 20, 35])
    return [o.token_ids for o in outs], metrics


@pytest.mark.parametrize("preset,k", [("glm5-shared-topk", 2), ("v32-half-rope", 3),
                                      matrix("glm5-shared-topk", 1), matrix("glm5-shared-topk", 3),
                                      matrix("v32-half-rope", 1), matrix("v32-half-rope", 2)])
def test_greedy_spec_equals_no_spec(dsa_ckpts, preset, k):
    """Token for token at K drafts, with drafts accepted (contexts up to 90 tokens, top-k 16). v32-half-rope's
    draft steps share the first step's top-k (``index_share_for_mtp_iteration``)."""
    path = dsa_ckpts[(preset, "agreeing")]
    ref, _ = _greedy(path, 0)
    got, metrics = _greedy(path, k)
    print(f"{preset} K={k}: acceptance per position {metrics.acceptance_per_position}")
    assert got == ref
    assert metrics.acceptance_per_position[0] > 0.3


@pytest.mark.slow
def test_compiled_equals_eager_without_recompiles_or_host_syncs(dsa_ckpts):
    """The GLM-5.2-shaped miniature (full and shared top-k layers, MoE) through inductor's graphs at K = 2: the
    tokens and acceptance of eager, 0 recompiles after warm-up (under ``fail_on_recompile``), 0 host syncs, 0
    graph failures, every bucket replayed."""
    from .conftest import generate_without_recompiles

    path = dsa_ckpts[("glm5-shared-topk", "agreeing")]
    cfg = EngineConfig(max_model_len=128, max_num_seqs=2, speculative=SpeculativeConfig(num_speculative_tokens=2),
                       graph=GraphModeConfig(backend="inductor", graph_batch_sizes=(1, 2)), adaptive_k=False)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 2048, (n,), generator=gen).tolist() for n in (40, 23, 55)]
    max_tokens = [30, 12, 35]
    compiled = load_engine(path, cfg, count_host_syncs=True)
    compiled.warmup(progress=False)
    got, stats, metrics = compiled.generate(prompts, SamplingParams(), max_tokens)
    eager = load_engine(path, dataclasses.replace(cfg, graph=EAGER))
    ref, _, ref_metrics = eager.generate(prompts, SamplingParams(), max_tokens)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert metrics.as_dict() == ref_metrics.as_dict() and metrics.acceptance_per_position[0] > 0.3
    assert (stats.backend, stats.recompiles_after_warmup, stats.host_syncs) == ("inductor", 0, 0)
    assert stats.graph_failures == 0 and stats.graph_host_ops == 0
    _, seen = generate_without_recompiles(compiled, prompts, max_tokens)
    assert seen == {1, 2}


@pytest.mark.parametrize("preset,shares", [("v32-half-rope", True), ("glm5-shared-topk", False)])
def test_draft_steps_reuse_the_first_steps_top_k_where_the_config_shares_it(dsa_ckpts, preset, shares, monkeypatch):
    """``index_share_for_mtp_iteration``: draft steps 2..K attend the top-k draft step 1 chose for each row's
    sampled token (vLLM's ``set_skip_topk``); without it each step selects its own."""
    from ascend_spec.graph.dsa.model import DsaAttention
    from ascend_spec.graph.steps import make_draft_step

    model = load_model(dsa_ckpts[(preset, "agreeing")])
    calls = []
    forward = DsaAttention.forward_paged_sparse

    def recording(self, x, inp, cache, selected=None):
        out, chosen = forward(self, x, inp, cache, selected)
        calls.append((selected, chosen))
        return out, chosen

    monkeypatch.setattr(DsaAttention, "forward_paged_sparse", recording)
    b, q, blocks = 2, 3, 4
    table = torch.tensor([[1, 2, 3, 0], [4, 5, 6, 0]])
    seq_lens = torch.tensor([40, 30])
    positions = seq_lens.view(-1, 1) - q + torch.arange(q)
    cache = model.cfg.layer_cache("pair", 8, BLOCK, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(0)
    for t in cache:
        t.copy_(torch.randn(t.shape, generator=gen))
    sample_idx = torch.tensor([2, 0])
    step = make_draft_step(model, 3, 128)
    with torch.no_grad():
        step(torch.randint(1, 2048, (b, q), generator=gen), positions,
             torch.randn(b, q, model.cfg.hidden_size, generator=gen), sample_idx, slots_for(positions, table, BLOCK),
             table, seq_lens, torch.full((b,), 128), cache)
    assert len(calls) == 3 and calls[0][0] is None
    first = calls[0][1][torch.arange(b), sample_idx].unsqueeze(1)  # [B, 1, topk]
    for selected, chosen in calls[1:]:
        if shares:
            assert torch.equal(selected, first) and torch.equal(chosen, first)
        else:
            assert selected is None and chosen.shape == first.shape and not torch.equal(chosen, first)


def test_fp8_sharded_checkpoint_loads_the_indexer_dequantised(dsa_ckpts, tmp_path):
    """DeepSeek-V3.2's fp8 checkpoints quantise the indexer's ``wq_b`` and ``wk`` as the other linears (block fp8
    with ``weight_scale_inv``; ``weights_proj`` stays float), in shards: loaded dequantised, in bf16 by default."""
    from ascend_spec.graph.checkpoint import INDEX_FILE
    from ascend_spec_tools.tiny_models import write_checkpoint

    fp8_dir = write_checkpoint(tmp_path / "fp8", "v32-half-rope", fp8=True, max_shard_bytes=1 << 20)
    names = json.loads((fp8_dir / INDEX_FILE).read_text())["weight_map"]
    wk = "model.layers.0.self_attn.indexer.wk.weight"
    assert wk + "_scale_inv" in names and "model.layers.0.self_attn.indexer.weights_proj.weight_scale_inv" not in names
    ref, got = load_model(dsa_ckpts[("v32-half-rope", "random")]), load_model(fp8_dir)
    assert got.lm_head.weight.dtype == torch.bfloat16
    w_ref, w_got = ref.get_parameter(wk), got.get_parameter(wk).float()
    assert 0 < (w_got - w_ref).abs().max() < 0.1 * w_ref.abs().max()


def test_bundled_dsa_miniature_drafts_exactly_with_sparse_attention():
    """The trained GLM-5-shaped miniature (top-32 attention, contexts past 100): greedy K = 2 equals no-spec token
    for token, with the first draft accepted more often than not."""
    from ascend_spec.models import BUNDLED_DSA_MODEL_DIR
    from ascend_spec.tokenizer import TextTokenizer

    tok = TextTokenizer(BUNDLED_DSA_MODEL_DIR)
    prompts = [tok.encode(t) for t in ("def fibonacci(n):\n", "class Stack:\n    def __init__(self",
                                       "import os\nimport sys\n\n", "with open(path) as f:\n")]

    def run(k):
        spec = SpeculativeConfig(num_speculative_tokens=k) if k else None
        eng = load_engine(BUNDLED_DSA_MODEL_DIR, EngineConfig(max_model_len=256, max_num_seqs=4, speculative=spec,
                                                              graph=EAGER, adaptive_k=False))
        outs, _, metrics = eng.generate(prompts, SamplingParams(), 96)
        return [o.token_ids for o in outs], metrics

    ref, _ = run(0)
    got, metrics = run(2)
    print(f"bundled DSA K=2: acceptance per position {metrics.acceptance_per_position}")
    assert got == ref
    assert metrics.acceptance_per_position[0] > 0.5


@pytest.mark.parametrize("kind,target,active", [("glm_moe_dsa", "743.91B", "41.78B"),
                                                ("deepseek_v32", "671.88B", "38.40B")])
def test_full_size_configs_as_transformers_writes_them(tmp_path, capsys, kind, target, active):
    """GLM-5's and DeepSeek-V3.2's own shapes (transformers 5.19's config defaults: ``rope_parameters``,
    ``mlp_layer_types``, top-2048 indexers) read and sized on the meta device: GLM-5's 744B total and ~40B active
    as published; V3.2 is V3's 671B plus its indexers."""
    from transformers import DeepseekV32Config, GlmMoeDsaConfig

    from ascend_spec.cli import build_parser

    hf = (GlmMoeDsaConfig if kind == "glm_moe_dsa" else DeepseekV32Config)().to_dict()
    hf.update(num_nextn_predict_layers=1,
              architectures=["GlmMoeDsaForCausalLM" if kind == "glm_moe_dsa" else "DeepseekV32ForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(hf))
    args = build_parser().parse_args(["inspect", "--model", str(tmp_path)])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    for fact in (f"target {target}", f"target {active}", "top-2048 by a lightning indexer"):
        assert fact in text, (fact, text)


@pytest.fixture(scope="module")
def npu_standin_module():
    """A ``torch_npu`` whose ops are ``torch.ops.npu.*`` declared with the torch_npu 2.14.0 wheel's own schemas and
    computing what the ops' documentation says (``tests/npu_standin.py``)."""
    import yaml

    from . import npu_standin
    from .test_torchair_contract import NPU_OP_DECLARATIONS, _download_wheel

    import zipfile

    with zipfile.ZipFile(_download_wheel()) as zf:
        decl = yaml.safe_load(zf.read(NPU_OP_DECLARATIONS))
    schemas = {}
    for section in decl.values():
        for entry in section if isinstance(section, list) else ():
            if isinstance(entry, dict) and "func" in entry:
                schemas.setdefault(entry["func"].split("(", 1)[0], entry["func"])
    return npu_standin.register(schemas)


def test_npu_kernels_compute_the_reference(dsa_ckpts, npu_standin_module, monkeypatch):
    """The NPU path (``npu_lightning_indexer`` + ``npu_sparse_flash_attention`` with int32 device lengths, TND
    queries, ``PA_BSND`` caches of block 128, ``sparse_mode`` 3; torch_npu's MoE ops and cache scatter) through the
    wheel's op schemas and CPU kernels that compute what the ops' documentation says: the reference kernel's
    logits over a prefill and decode steps, and the same drafts from the draft chain."""
    from ascend_spec.graph.steps import make_draft_step

    monkeypatch.setitem(__import__("sys").modules, "torch_npu", npu_standin_module)
    path = dsa_ckpts[("glm5-shared-topk", "agreeing")]
    ref, npu = load_model(path), load_model(path)
    npu.set_attention_kernel("npu")
    assert not npu.takes_host_lengths
    ids = torch.randint(1, 2048, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got, want = _paged_logits(npu, ids), _paged_logits(ref, ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # the draft chain, two rows, a pad row, block 128
    block = 128
    table = torch.tensor([[1, 0], [2, 0], [0, 0]])
    seq_lens = torch.tensor([50, 35, 0])
    positions = (seq_lens.view(-1, 1) - 3 + torch.arange(3)).clamp(min=0)
    slots = torch.where(seq_lens.view(-1, 1) > 0, slots_for(positions, table, block), -1)
    gen = torch.Generator().manual_seed(4)
    inputs = (torch.randint(1, 2048, (3, 3), generator=gen), positions,
              torch.randn(3, 3, ref.cfg.hidden_size, generator=gen), torch.tensor([2, 1, 0]), slots, table, seq_lens,
              torch.full((3,), 128))
    drafts = []
    for model in (ref, npu):
        cache = model.cfg.layer_cache("pair", 3, block, torch.float32, "cpu")
        for t in cache:
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(5)))
        with torch.no_grad():
            drafts.append(make_draft_step(model, 3, 128)(*inputs, cache))
    assert torch.equal(drafts[0][0][:2], drafts[1][0][:2])
    torch.testing.assert_close(drafts[0][1][:2], drafts[1][1][:2], atol=1e-4, rtol=1e-4)
