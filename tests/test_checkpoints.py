"""Checkpoint formats: sharded through an index (lazy, MTP-only), DeepSeek block-fp8, dtypes, loader errors."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from ascend_spec.graph.checkpoint import INDEX_FILE, dequantize_fp8_block, quantize_fp8_block
from ascend_spec.graph.config import ConfigError
from ascend_spec.graph.weights import WeightLoadError, load_model, mtp_parameter
from ascend_spec_tools.tiny_models import write_checkpoint

PRESET = "moe-e16-k4"


def _tensor_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type != "meta")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("sharded"), PRESET, max_shard_bytes=512 * 1024)


def test_sharded_load_equals_single_file(moe_ckpts, sharded):
    assert (sharded / INDEX_FILE).is_file() and len(list(sharded.glob("*.safetensors"))) > 10
    a, b = load_model(moe_ckpts[PRESET]), load_model(sharded)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name


def test_mtp_only_load_reads_no_target_layer(sharded, tmp_path):
    """Shards that hold only target-layer tensors are deleted: the MTP-only load must not need them."""
    weight_map = json.loads((sharded / INDEX_FILE).read_text())["weight_map"]
    cfg_n = json.loads((sharded / "config.json").read_text())["num_hidden_layers"]

    def is_mtp(name: str) -> bool:
        return name in ("model.embed_tokens.weight", "lm_head.weight") or (
            name.startswith("model.layers.") and int(name.split(".")[2]) >= cfg_n)

    needed = {f for n, f in weight_map.items() if is_mtp(n)}
    for path in sharded.iterdir():
        (tmp_path / path.name).symlink_to(path)
    removed = [f for f in set(weight_map.values()) - needed]
    for f in removed:
        (tmp_path / f).unlink()
    assert removed, "the shard size should leave some shards with target layers only"

    full = load_model(sharded)
    mtp = load_model(tmp_path, part="mtp")
    for name, p in mtp.named_parameters():
        if mtp_parameter(name, mtp.cfg):
            assert torch.equal(p, full.get_parameter(name)), name
        else:
            assert p.device.type == "meta", name  # target layers are never materialised
    print(f"MTP-only load: {_tensor_bytes(mtp) / 2**20:.2f} MiB of tensors vs {_tensor_bytes(full) / 2**20:.2f} MiB "
          f"for the full model; {len(needed)} of {len(set(weight_map.values()))} shards opened")
    with pytest.raises(WeightLoadError, match=r"is mapped to model-\d+-of-\d+\.safetensors, which is not in"):
        load_model(tmp_path)


def test_mtp_only_load_drafts_like_the_full_model(sharded):
    from ascend_spec.graph.paging import PagedInputs

    full, mtp = load_model(sharded), load_model(sharded, part="mtp")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 2048, (2, 3), generator=gen)
    hidden = torch.randn(2, 3, full.cfg.hidden_size, generator=gen)
    inp = PagedInputs(torch.arange(3).expand(2, 3), torch.tensor([[16, 17, 18], [32, 33, 34]]),
                      torch.tensor([[1], [2]]), torch.tensor([3, 3]))
    outs = []
    for model in (full, mtp):
        cache = torch.zeros(3, 16, 576)
        with torch.no_grad():
            outs.append(model.mtp_logits(model.mtp_paged(ids, hidden, inp, cache)[0]))
    assert torch.equal(outs[0], outs[1])


def test_fp8_block_dequantisation_by_hand():
    w = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]).to(torch.float8_e4m3fn)
    scale_inv = torch.tensor([[2.0, 10.0], [0.5, 1.0]])
    got = dequantize_fp8_block(w, scale_inv, (2, 2))
    expected = torch.tensor([[2.0, 4.0, 30.0], [8.0, 10.0, 60.0], [3.5, 4.0, 9.0]])
    assert torch.equal(got, expected)
    with pytest.raises(WeightLoadError, match=r"w_scale_inv has shape \[1, 2\]; a \[3, 3\] weight in \[2, 2\] "
                                              r"blocks needs \[2, 2\]"):
        dequantize_fp8_block(w, scale_inv[:1], (2, 2), "w")


def test_fp8_roundtrip_error_is_fp8_sized():
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(0))
    q, s = quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 2)
    rel = ((dequantize_fp8_block(q, s, (128, 128)) - w).abs() / w.abs().clamp(min=1e-3)).median()
    assert rel < 0.04  # e4m3 keeps 3 mantissa bits: ≤ 6.25% per value, ~2% typical


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_checkpoint_loads_dequantised(moe_ckpts, tmp_path, dtype):
    fp8_dir = write_checkpoint(tmp_path / "fp8", PRESET, fp8=True, max_shard_bytes=1 << 20)
    names = json.loads((fp8_dir / INDEX_FILE).read_text())["weight_map"]
    assert "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv" in names
    ref = load_model(moe_ckpts[PRESET])
    got = load_model(fp8_dir, dtype=dtype)
    assert got.lm_head.weight.dtype == getattr(torch, dtype)
    w_ref = ref.get_parameter("model.layers.1.mlp.experts.w13_weight")
    w_got = got.get_parameter("model.layers.1.mlp.experts.w13_weight").float()
    assert 0 < (w_got - w_ref).abs().max() < 0.1 * w_ref.abs().max()
    # Weights not quantised in DeepSeek's checkpoints load exactly.
    assert torch.equal(got.get_parameter("model.layers.1.mlp.gate.weight").float(),
                       ref.get_parameter("model.layers.1.mlp.gate.weight").to(getattr(torch, dtype)).float())


def test_fp8_checkpoint_defaults_to_bfloat16_and_needs_scales(tmp_path):
    fp8_dir = write_checkpoint(tmp_path / "fp8", "moe-mtp-only-e8-k2", fp8=True)
    assert load_model(fp8_dir).lm_head.weight.dtype == torch.bfloat16  # fp8 + torch_dtype float32 → bf16
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    name = "model.layers.0.self_attn.o_proj.weight"
    del tensors[name + "_scale_inv"]
    save_file(tensors, str(fp8_dir / "model.safetensors"))
    with pytest.raises(WeightLoadError, match=f"tensor '{name}' is float8_e4m3fn but the checkpoint has no "
                                              f"'{name}_scale_inv'"):
        load_model(fp8_dir)


def test_bad_dtype_is_named(moe_ckpts):
    with pytest.raises(ConfigError, match=r"dtype='float8'; allowed: \['float32', 'bfloat16', 'float16'\]"):
        load_model(moe_ckpts[PRESET], dtype="float8")


def _rewrite(src, dst, edit):
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def test_missing_expert_tensor_names_it_and_its_shape(moe_ckpts, tmp_path):
    name = "model.layers.2.mlp.experts.5.up_proj.weight"
    bad = _rewrite(moe_ckpts[PRESET], tmp_path / "bad", lambda t: t.pop(name))
    with pytest.raises(WeightLoadError, match=rf"missing tensor '{name}' \(expected shape \[64, 128\]\)"):
        load_model(bad)


def test_expert_count_must_match_the_config(moe_ckpts, tmp_path):
    """The config says 8 experts, the checkpoint has 16: one line per MoE layer saying so."""
    src = moe_ckpts[PRESET]
    bad = _rewrite(src, tmp_path / "bad", lambda t: None)
    hf = json.loads((src / "config.json").read_text())
    hf.update(n_routed_experts=8)
    (bad / "config.json").write_text(json.dumps(hf))
    with pytest.raises(WeightLoadError) as err:
        load_model(bad)
    msg = str(err.value)
    assert ("model.layers.1.mlp.experts holds expert ids up to 15 (16 experts) but config.json's "
            "n_routed_experts=8") in msg
    assert "model.layers.2.mlp.experts holds expert ids up to 15" in msg
    assert "unexpected tensor" not in msg  # the surplus experts are reported once, not tensor by tensor
    assert "shape mismatch for 'model.layers.1.mlp.gate.weight': expected [8, 128], found [16, 128]" in msg


def test_mtp_copies_of_embedding_and_head_are_optional(moe_ckpts, tmp_path):
    """vLLM drafts with the target's embedding/head; a checkpoint without the MTP layer's copies still loads."""
    src = moe_ckpts[PRESET]

    def drop(t):
        t.pop("model.layers.2.embed_tokens.weight")
        t.pop("model.layers.2.shared_head.head.weight")

    trimmed = _rewrite(src, tmp_path / "trimmed", drop)
    a, b = load_model(src), load_model(trimmed)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
