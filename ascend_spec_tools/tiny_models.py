"""Deterministic random DeepSeek-V3 checkpoints (MoE, YaRN, q_lora, fp8, shards) for tests, parity and benchmarks.

Each preset is a miniature of one real-model feature mix; ``tools/make_tiny_moe.py`` writes them from the
command line. Weights come from a seeded generator, so a preset and a seed always give the same bytes. The
bundled checkpoint's tokenizer is copied alongside, so vLLM and ``ascend-spec generate`` can run them.
"""
from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import torch

from ascend_spec.graph.config import ModelConfig, MoEConfig, YarnScaling
from ascend_spec.graph.dsa.config import DsaConfig, IndexerConfig
from ascend_spec.graph.families import build_model
from ascend_spec.graph.model import DeepseekV3ForCausalLM
from ascend_spec.graph.weights import fp8_quantization_config, save_model
from ascend_spec.models import FIXTURE_MODEL_DIR

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")

_BASE = dict(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32, q_lora_rank=96,
             eos_token_id=0, bos_token_id=0)

#: name → config. Varies E, top-k, n_group/topk_group, first_k_dense_replace, the YaRN factor and q_lora_rank.
PRESETS: dict[str, ModelConfig] = {
    # DeepSeek-V3's shape in miniature: dense layer 0, MoE layer 1 and MoE MTP layer, 4 groups keep 2, YaRN ×4.
    "moe-e16-k4": ModelConfig(**_BASE, max_position_embeddings=512,
                              moe=MoEConfig(n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=64,
                                            n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                            first_k_dense_replace=1),
                              rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=128,
                                                       mscale=1.0, mscale_all_dim=1.0)),
    # Every layer MoE, 8 groups keep 3, top-8 of 64, two shared experts, YaRN ×40 with mscale ≠ mscale_all_dim.
    "moe-e64-k8": ModelConfig(**_BASE, max_position_embeddings=1280,
                              moe=MoEConfig(n_routed_experts=64, num_experts_per_tok=8, moe_intermediate_size=32,
                                            n_shared_experts=2, n_group=8, topk_group=3, routed_scaling_factor=1.5,
                                            first_k_dense_replace=0),
                              rope_scaling=YarnScaling(factor=40.0, original_max_position_embeddings=32,
                                                       beta_fast=32, beta_slow=1, mscale=0.9, mscale_all_dim=1.0)),
    # Dense target, only the MTP layer MoE (first_k_dense_replace = num_hidden_layers), no q_lora, no groups.
    "moe-mtp-only-e8-k2": ModelConfig(**{**_BASE, "q_lora_rank": None}, max_position_embeddings=512,
                                      moe=MoEConfig(n_routed_experts=8, num_experts_per_tok=2,
                                                    moe_intermediate_size=64, n_shared_experts=1,
                                                    routed_scaling_factor=1.0, norm_topk_prob=False,
                                                    first_k_dense_replace=2),
                                      rope_scaling=YarnScaling(factor=2.0, original_max_position_embeddings=256,
                                                               mscale=1.0, mscale_all_dim=1.0)),
}


_DSA_BASE = dict(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                 kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, q_lora_rank=96,
                 eos_token_id=0, bos_token_id=0, max_position_embeddings=512)
#: the DSA family (DeepSeek-V3.2, GLM-5.x) in miniature: ``index_topk`` 16, below every context the tests use, so
#: the indexer's selection changes what attention reads. Name → config.
DSA_PRESETS: dict[str, DsaConfig] = {
    # GLM-5.2's shape: MoE from layer 1, layer 1 reuses layer 0's top-k (indexer_types full/shared), interleaved
    # indexer RoPE, YaRN
    "glm5-shared-topk": DsaConfig(**_DSA_BASE, model_type="glm_moe_dsa",
                                  moe=MoEConfig(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                                n_shared_experts=1, routed_scaling_factor=2.5,
                                                first_k_dense_replace=1),
                                  rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=128,
                                                           mscale=1.0, mscale_all_dim=1.0),
                                  indexer=IndexerConfig(n_heads=8, head_dim=32, topk=16, rope="interleaved",
                                                        layer_types=("full", "shared", "full"))),
    # DeepSeek-V3.2's: every layer its own indexer, half-split indexer RoPE, dense, draft steps share the top-k
    "v32-half-rope": DsaConfig(**_DSA_BASE, model_type="deepseek_v32",
                               indexer=IndexerConfig(n_heads=8, head_dim=32, topk=16, rope="half",
                                                     layer_types=("full",) * 3, share_for_mtp=True)),
}


def random_weights(model: DeepseekV3ForCausalLM, seed: int = 0, std: float = 0.08) -> DeepseekV3ForCausalLM:
    """Fill every parameter from a seeded generator: matrices and LayerNorm biases N(0, std), norm weights U(0.8, 1.2),
    gate bias U(0, 0.05)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.copy_(torch.rand(p.shape, generator=gen) * 0.05)
            elif name.endswith(".bias"):  # LayerNorm's (the DSA indexer's k_norm)
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            else:
                p.copy_(torch.rand(p.shape, generator=gen) * 0.4 + 0.8)
    return model.eval()


def write_checkpoint(out_dir: str | Path, cfg: ModelConfig | str, seed: int = 0, dtype: str = "float32",
                     max_shard_bytes: int | None = None, fp8: bool = False) -> Path:
    """Write ``config.json`` + safetensors (+ the bundled tokenizer) for ``cfg`` (a preset name or a config)."""
    if isinstance(cfg, str):
        presets = {**PRESETS, **DSA_PRESETS}
        if cfg not in presets:
            raise ValueError(f"unknown preset {cfg!r}; allowed: {sorted(presets)}")
        cfg = presets[cfg]
    cfg = dataclasses.replace(cfg, torch_dtype=dtype)
    hf = cfg.to_hf_dict()
    if fp8:
        hf["quantization_config"] = fp8_quantization_config()
    return _write_folder(out_dir, random_weights(build_model(cfg), seed), hf,
                         max_shard_bytes=max_shard_bytes, fp8_block=(128, 128) if fp8 else None)


def _write_folder(out_dir: str | Path, model: DeepseekV3ForCausalLM, hf: dict, **save_kwargs) -> Path:
    """Weights (``save_model``), ``config.json`` and the bundled tokenizer files into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_model(model, out, dtype=model.cfg.dtype, **save_kwargs)
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (FIXTURE_MODEL_DIR / name).is_file():
            shutil.copy(FIXTURE_MODEL_DIR / name, out / name)
    return out


def moe_from_bundled(out_dir: str | Path, seed: int = 0, num_experts: int = 16, top_k: int = 4,
                     yarn_factor: float = 2.0, routed_std: float = 0.004) -> Path:
    """The small trained fixture model turned into a MoE + YaRN DeepSeek-V3 whose drafts get accepted.

    Layer 0 stays dense; layer 1 and the MTP layer become DeepSeekMoE: the shared experts (4 × 128) are the
    trained dense MLP, split exactly; 16 routed experts (top-4 of 4 groups keeping 2, bias-corrected sigmoid
    routing) add small random terms, so routing changes the numbers without erasing what was learnt. RoPE
    becomes YaRN ×2 over the first half of the context. Random MoE checkpoints draft nothing useful
    (acceptance ≈ 0), which would leave the speculative paths barely exercised; this one keeps acceptance.
    """
    from ascend_spec.graph.weights import load_model

    dense = load_model(FIXTURE_MODEL_DIR)
    base = dense.cfg
    shared_parts = 4
    cfg = dataclasses.replace(
        base, torch_dtype="float32",
        moe=MoEConfig(n_routed_experts=num_experts, num_experts_per_tok=top_k,
                      moe_intermediate_size=base.intermediate_size // shared_parts, n_shared_experts=shared_parts,
                      n_group=4, topk_group=2, routed_scaling_factor=1.0, first_k_dense_replace=1),
        rope_scaling=YarnScaling(factor=yarn_factor,
                                 original_max_position_embeddings=int(base.max_position_embeddings / yarn_factor),
                                 mscale=1.0, mscale_all_dim=1.0))
    model = random_weights(DeepseekV3ForCausalLM(cfg), seed, std=routed_std)
    trained = dict(dense.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in trained and trained[name].shape == p.shape:
                p.copy_(trained[name])
            elif ".shared_experts." in name:
                p.copy_(trained[name.replace(".shared_experts.", ".")])
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(seed + 1))
    return _write_folder(out_dir, model, cfg.to_hf_dict())


#: compressed-tensors W8A8-int8 targets: the attention projections, dense MLPs and shared experts (vLLM fuses
#: q_a_proj + kv_a_proj_with_mqa and gate_proj + up_proj; every shard of a fused layer is quantised alike).
W8A8_LINEAR = re.compile(r"\.(self_attn\.(q_a_proj|kv_a_proj_with_mqa|q_b_proj|q_proj|o_proj)"
                         r"|mlp\.(shared_experts\.)?(gate_proj|up_proj|down_proj))\.weight$")
#: Kept float: routed experts (vLLM-CPU has no quantised MoE kernel on AVX2/AVX-512 without AMX), kv_b_proj
#: (vLLM dequantises it anyway for the absorbed MLA matrices), and the MTP layer's eh_proj / shared head (plain
#: nn.Linear / the target's lm_head in vLLM).
W8A8_IGNORE = ["lm_head", r"re:.*mlp\.experts\..*", r"re:.*\.kv_b_proj$", "re:.*eh_proj$", "re:.*shared_head.*"]
#: Largest int8 magnitude written: oneDNN's int8 GEMM without VNNI (AVX2) sums u8·s8 pairs in int16 and saturates
#: at full range; |q| ≤ 63 keeps it exact, and the file stays a valid compressed-tensors checkpoint.
W8A8_QMAX = 63


def w8a8_quantization_config(ignore: list[str] = W8A8_IGNORE) -> dict:
    """compressed-tensors ``int-quantized``: int8 per-output-channel symmetric weights, dynamic per-token int8
    activations (vLLM's ``CompressedTensorsW8A8Int8``; oneDNN on CPUs); ``ignore``: layers kept float."""
    int8 = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": False}
    return {"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**int8, "strategy": "channel"},
                                          "input_activations": {**int8, "strategy": "token", "dynamic": True}}},
            "ignore": list(ignore), "kv_cache_scheme": None}


def w8a8_from(src_dir: str | Path, out_dir: str | Path, float_mtp: bool = False) -> Path:
    """A float checkpoint rewritten as compressed-tensors W8A8-int8 (see ``W8A8_LINEAR`` / ``W8A8_IGNORE``):
    ``<layer>.weight`` int8 ``[out, in]`` and ``<layer>.weight_scale`` fp32 ``[out, 1]``; the rest as it was.
    ``float_mtp``: the MTP layer stays float (vllm-ascend's W8A8 deployments). Deterministic (round to nearest)."""
    from safetensors.torch import load_file, save_file

    src, out = Path(src_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf = json.loads((src / "config.json").read_text())
    if hf.get("quantization_config"):
        raise ValueError(f"{src}: already quantised ({hf['quantization_config'].get('quant_method')}); "
                         "w8a8_from takes a float checkpoint")
    ignore = list(W8A8_IGNORE)
    if float_mtp:
        ignore.append(rf"re:model\.layers\.{hf['num_hidden_layers']}\..*")
    skip = [re.compile(i[3:]) for i in ignore if i.startswith("re:")]
    weight_map: dict[str, str] = {}
    for shard in sorted(src.glob("*.safetensors")):
        tensors = {}
        for name, w in load_file(shard).items():
            if W8A8_LINEAR.search(name) and not any(r.match(name[: -len(".weight")]) for r in skip):
                scale = w.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / W8A8_QMAX
                tensors[name] = (w.float() / scale).round().clamp(-W8A8_QMAX, W8A8_QMAX).to(torch.int8)
                tensors[name[: -len("weight")] + "weight_scale"] = scale
            else:
                tensors[name] = w
        save_file(tensors, out / shard.name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard.name))
    index = src / "model.safetensors.index.json"
    if index.is_file():  # sharded: the index gains the scales
        (out / index.name).write_text(json.dumps({**json.loads(index.read_text()), "weight_map": weight_map}))
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    hf["quantization_config"] = w8a8_quantization_config(ignore)
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return out


def agreeing_checkpoint(out_dir: str | Path, cfg: ModelConfig | str, seed: int = 0, layer_scale: float = 0.1) -> Path:
    """A random checkpoint whose drafts get accepted (about 60 / 45 / 25% at draft positions 1..3 on the DSA
    presets): random weights, every layer's output projection scaled by ``layer_scale`` and the embedding ×12, so
    the target's next token is mostly a function of the current one; the MTP layer passes the next token's
    normalised embedding through (``eh_proj`` ≈ [I, ·]) and shares the final norm, so it predicts the same function
    one token later. Until a trained miniature of a family exists, its speculative paths see acceptance here."""
    if isinstance(cfg, str):
        cfg = {**PRESETS, **DSA_PRESETS}[cfg]
    model = random_weights(build_model(cfg), seed)
    d = cfg.hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "w2_weight")):
                p.mul_(layer_scale)
        model.model.embed_tokens.weight.mul_(12.0)
        mtp = model.mtp_layer(0)
        mtp.eh_proj.weight.mul_(layer_scale)
        mtp.eh_proj.weight[:, :d] += torch.eye(d)
        mtp.enorm.weight.fill_(1.0)
        mtp.shared_head.norm.weight.copy_(model.model.norm.weight)
    return _write_folder(out_dir, model, cfg.to_hf_dict())
