"""``ascend-spec inspect``: deployment sizing from config.json alone (DeepSeek-V3's real config, tiny presets)."""
import argparse
import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from ascend_spec.graph.config import ConfigError
from ascend_spec.graph.weights import load_model
from ascend_spec.model_info import add_inspect_parser, cmd_inspect, format_report, inspect_model
from ascend_spec.models import BUNDLED_MODEL_DIR
from ascend_spec_tools.tiny_models import write_checkpoint

DSV3_CONFIG = Path(__file__).parent / "data" / "deepseek-v3-config.json"

# DeepSeek-V3 by hand (D = 7168, V = 129280, 128 heads):
#   attention  q_a 7168·1536 + q_a_norm 1536 + q_b 1536·(128·192) + kv_a 7168·576 + kv_a_norm 512
#              + kv_b 512·(128·256) + o 16384·7168                                   = 187,107,328
#   norms      2·7168                                                                =      14,336
#   dense MLP  3·7168·18432                                                          = 396,361,728
#   MoE        256 experts · 3·7168·2048 (11,274,289,152) + shared 3·7168·2048 (44,040,192)
#              + gate 256·7168 + e_score_correction_bias 256 (1,835,264)             = 11,320,164,608
#   dense layer = 583,483,392; MoE layer = 11,507,286,272
#   target = 2·V·D (1,853,358,080) + final norm 7168 + 3 dense + 58 MoE layers       = 671,026,419,200
#   mtp    = one MoE layer + enorm/hnorm 2·7168 + eh_proj 14336·7168 + shared_head.norm 7168 = 11,610,068,224
EMBED = 129280 * 7168
ATTN = 7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256 + 128 * 128 * 7168
EXPERT = 3 * 7168 * 2048
MOE_LAYER = ATTN + 2 * 7168 + 257 * EXPERT + 256 * 7168 + 256
DENSE_LAYER = ATTN + 2 * 7168 + 3 * 7168 * 18432
TARGET = 2 * EMBED + 7168 + 3 * DENSE_LAYER + 58 * MOE_LAYER
MTP = MOE_LAYER + 3 * 7168 + 2 * 7168 * 7168


@pytest.fixture()
def dsv3_dir(tmp_path: Path) -> Path:
    """A folder holding DeepSeek-V3's config.json and nothing else: any weight read would fail."""
    shutil.copy(DSV3_CONFIG, tmp_path / "config.json")
    return tmp_path


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ascend-spec")
    add_inspect_parser(ap.add_subparsers(dest="command", required=True))
    return ap


def test_deepseek_v3_counts(dsv3_dir: Path, monkeypatch):
    # Sizing reads config.json only: no checkpoint is opened, and nothing but config.json is there to open.
    import ascend_spec.graph.checkpoint as checkpoint

    def no_weights(*args, **kwargs):
        raise AssertionError("inspect opened a checkpoint file")

    monkeypatch.setattr(checkpoint, "safe_open", no_weights)
    info = inspect_model(dsv3_dir)
    assert list(dsv3_dir.iterdir()) == [dsv3_dir / "config.json"]

    p = info["parameters"]
    assert p["target"] == TARGET == 671_026_419_200
    assert p["target"] == pytest.approx(671.0e9, rel=1e-3)
    assert p["mtp"] == MTP == 11_610_068_224
    assert p["mtp"] == pytest.approx(11.6e9, rel=1e-2)
    assert p["embedding"] == p["lm_head"] == EMBED == 926_679_040
    assert p["total"] == TARGET + MTP

    assert info["architecture"] == "DeepseekV3ForCausalLM"
    assert info["layers"] == {"num_hidden_layers": 61, "mtp_layers": [61], "dense": [0, 1, 2],
                              "moe": list(range(3, 62))}
    moe = info["moe"]
    assert (moe["n_routed_experts"], moe["num_experts_per_tok"], moe["n_group"], moe["topk_group"]) == (256, 8, 8, 4)
    # 248 of 256 routed experts idle per token, in 58 target MoE layers and the MTP layer.
    assert moe["active_parameters_per_token"] == {"target": TARGET - 58 * 248 * EXPERT, "mtp": MTP - 248 * EXPERT}

    assert info["kv_cache_bytes_per_token"]["bfloat16"] == {"target": 61 * 576 * 2, "mtp": 576 * 2}
    assert info["kv_cache_bytes_per_token"]["float32"] == {"target": 61 * 576 * 4, "mtp": 576 * 4}
    b = info["bytes"]
    assert b["float32"]["target"] == 4 * TARGET
    assert b["bfloat16"]["target"] == 2 * TARGET + 2 * 58 * 256  # the router bias stays fp32
    assert b["float16"] == b["bfloat16"]
    assert 0.5 * b["bfloat16"]["target"] < b["fp8"]["target"] < 0.51 * b["bfloat16"]["target"]
    assert info["softmax_scale"] == pytest.approx(0.1352, abs=1e-4)
    assert info["rope_scaling"]["factor"] == 40 and info["checkpoint_dtype"] == "bfloat16"
    assert info["quantization"] == {"method": "fp8", "weight_block_size": [128, 128]}


def test_cli_json_and_text(dsv3_dir: Path, capsys):
    args = _parser().parse_args(["inspect", "--model", str(dsv3_dir), "--json"])
    assert args.func is cmd_inspect and cmd_inspect(args) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["parameters"]["target"] == TARGET and info["layers"]["mtp_layers"] == [61]

    assert cmd_inspect(_parser().parse_args(["inspect", "--model", str(dsv3_dir)])) == 0
    text = capsys.readouterr().out
    assert text == format_report(info) + "\n"
    for fact in ("671.03B", "11.61B", "0.93B", "37.55B", "dense 0-2", "MoE 3-61", "70,272 B"):
        assert fact in text, fact


def test_cli_default_is_bundled(capsys):
    args = _parser().parse_args(["inspect", "--json"])
    assert args.model == BUNDLED_MODEL_DIR
    assert cmd_inspect(args) == 0
    assert json.loads(capsys.readouterr().out)["moe"] is None  # the bundled miniature is dense


@pytest.mark.parametrize("change, key", [
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.type='dynamic'"),
    ({"topk_group": 9}, "topk_group=9 > n_group=8"),
    ({"model_type": "llama"}, "model_type='llama'"),
    ({"rope_scaling": "yarn"}, "malformed"),
])
def test_bad_config(tmp_path: Path, change: dict, key: str):
    hf = {**json.loads(DSV3_CONFIG.read_text()), **change}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ConfigError, match=key.replace("(", r"\(").replace(")", r"\)")):
        inspect_model(tmp_path)


def test_missing_or_unreadable_config(tmp_path: Path):
    with pytest.raises(ConfigError, match="no config.json"):
        inspect_model(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not readable JSON"):
        inspect_model(tmp_path)


def _split_numel(model, n_layers: int) -> dict[str, int]:
    out = {"target": 0, "mtp": 0, "embedding": 0, "lm_head": 0}
    for name, p in model.named_parameters():
        if name == "model.embed_tokens.weight":
            out["embedding"] += p.numel()
        elif name == "lm_head.weight":
            out["lm_head"] += p.numel()
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= n_layers:
            out["mtp"] += p.numel()
        else:
            out["target"] += p.numel()
    return out


def _checkpoint_bytes(model_dir: Path, n_layers: int) -> int:
    """Bytes on disk, less the MTP layer's copies of embed_tokens / shared_head.head (shared when serving)."""
    tensors = load_file(str(model_dir / "model.safetensors"))
    return sum(t.numel() * t.element_size() for name, t in tensors.items()
               if not (name.startswith(f"model.layers.{n_layers}.")
                       and name.endswith(("embed_tokens.weight", "shared_head.head.weight"))))


@pytest.mark.parametrize("preset", ["moe-e16-k4", "moe-mtp-only-e8-k2"])
def test_meta_count_matches_real_checkpoint(tmp_path: Path, preset: str):
    bf16 = write_checkpoint(tmp_path / "bf16", preset, dtype="bfloat16")
    info = inspect_model(bf16)
    n = info["layers"]["num_hidden_layers"]
    params = info["parameters"]
    assert _split_numel(load_model(bf16), n) == {k: params[k] for k in ("target", "mtp", "embedding", "lm_head")}
    bytes_bf16 = info["bytes"]["bfloat16"]
    assert _checkpoint_bytes(bf16, n) == bytes_bf16["target"] + bytes_bf16["mtp"]

    # DeepSeek's fp8 layout (1-byte weights + fp32 block scales; 64-wide experts leave partial 128-blocks).
    fp8 = write_checkpoint(tmp_path / "fp8", preset, dtype="bfloat16", fp8=True)
    bytes_fp8 = inspect_model(fp8)["bytes"]["fp8"]
    assert _checkpoint_bytes(fp8, n) == bytes_fp8["target"] + bytes_fp8["mtp"]
