"""``ascend-spec inspect``: size a DeepSeek-V3 deployment from ``config.json`` alone (no weights read).
It counts the parameters of a model built on the meta device, the modules ``load_model`` fills.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from .graph.config import DTYPES
from .graph.families import build_model, config_from_dir
from .graph.weights import FP8_LINEARS, parameter_part
from .models import BUNDLED_MODEL_DIR, NAMED_MODELS

KV_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float32": torch.float32}
FP32_PARAMS = ("e_score_correction_bias",)  # held in fp32 whatever the model dtype (MoEGate, hf_state_dict)
GIB = 2 ** 30


def _scale_blocks(rows: int, cols: int, block: tuple[int, int]) -> int:
    return math.ceil(rows / block[0]) * math.ceil(cols / block[1])


def _fp8_bytes(name: str, shape: tuple[int, ...], block: tuple[int, int]) -> int | None:
    """Bytes of a weight in DeepSeek's block-fp8 checkpoint (1-byte values + fp32 scales), None if not fp8."""
    if not name.startswith("model.layers."):
        return None
    # Stacked experts are stored per expert, and w13 as separate gate / up matrices, each with its own scales.
    if name.endswith(".mlp.experts.w13_weight"):
        e, two_i, d = shape
        return e * 2 * ((two_i // 2) * d + 4 * _scale_blocks(two_i // 2, d, block))
    if name.endswith(".mlp.experts.w2_weight"):
        e, d, i = shape
        return e * (d * i + 4 * _scale_blocks(d, i, block))
    if name.endswith(".weight") and name.rsplit(".", 2)[-2] in FP8_LINEARS and len(shape) == 2:
        return shape[0] * shape[1] + 4 * _scale_blocks(shape[0], shape[1], block)
    return None


def _param_bytes(name: str, shape: tuple[int, ...], numel: int, dtype: str, block: tuple[int, int]) -> int:
    if name.endswith(FP32_PARAMS):
        return 4 * numel
    if dtype == "fp8":
        fp8 = _fp8_bytes(name, shape, block)
        return fp8 if fp8 is not None else 2 * numel  # router, norms, eh_proj, embedding, head: bf16
    return numel * DTYPES[dtype].itemsize


def inspect_model(model_dir: str | Path) -> dict:
    """Parameter counts, weight bytes per dtype and KV-cache bytes per token, from ``config.json`` only.

    ``target`` is the whole main model, embedding and lm_head included; ``mtp`` is the MTP layer(s)' own
    parameters only. DeepSeek-V3's checkpoint also stores the MTP layer's copies of embed_tokens and
    shared_head.head (2 × 0.93B), but serving shares the target's (vLLM and us), so they are not counted.
    Bytes are params × element size, except the router's ``e_score_correction_bias`` (always fp32, as the model
    and checkpoints hold it); ``fp8`` is DeepSeek's scheme: FP8_LINEARS inside the layers at 1 byte plus one fp32
    ``weight_scale_inv`` per block (per expert for stacked experts), everything else bf16.
    """
    model_dir = Path(model_dir)
    cfg = config_from_dir(model_dir)
    with torch.device("meta"):  # shapes only: no allocation, no weights
        model = build_model(cfg)
    block = cfg.quantization.weight_block_size if cfg.quantization else (128, 128)
    dtypes = [*DTYPES, "fp8"]

    counts = {"target": 0, "mtp": 0, "embedding": 0, "lm_head": 0}
    nbytes = {dt: {"target": 0, "mtp": 0} for dt in dtypes}
    inactive = {"target": 0, "mtp": 0}  # routed-expert parameters a token does not touch
    for name, p in model.named_parameters():
        part, n = parameter_part(name, cfg), p.numel()
        counts[part] += n
        side = "mtp" if part == "mtp" else "target"  # embedding and head belong to the target
        if part in ("embedding", "lm_head"):
            counts["target"] += n
        for dt in dtypes:
            nbytes[dt][side] += _param_bytes(name, tuple(p.shape), n, dt, block)
        if cfg.moe is not None and name.endswith((".mlp.experts.w13_weight", ".mlp.experts.w2_weight")):
            e, k = cfg.moe.n_routed_experts, cfg.moe.num_experts_per_tok
            inactive[side] += n // e * (e - k)

    layers = range(cfg.num_layers_with_mtp)
    moe_info = None
    if cfg.moe is not None:
        m = cfg.moe
        moe_info = {"n_routed_experts": m.n_routed_experts, "num_experts_per_tok": m.num_experts_per_tok,
                    "n_shared_experts": m.n_shared_experts, "moe_intermediate_size": m.moe_intermediate_size,
                    "n_group": m.n_group, "topk_group": m.topk_group,
                    # Everything but the unchosen routed experts (the whole embedding counts, kept simple).
                    "active_parameters_per_token": {s: counts[s] - inactive[s] for s in ("target", "mtp")}}
    return {
        "model": str(model_dir),
        "architecture": cfg.to_hf_dict()["architectures"][0],
        "parameters": {**counts, "total": counts["target"] + counts["mtp"]},
        "layers": {"num_hidden_layers": cfg.num_hidden_layers,
                   "mtp_layers": list(range(cfg.num_hidden_layers, cfg.num_layers_with_mtp)),
                   "dense": [i for i in layers if not cfg.is_moe_layer(i)],
                   "moe": [i for i in layers if cfg.is_moe_layer(i)]},
        "moe": moe_info,
        "rope_scaling": cfg.rope_scaling.to_hf() if cfg.rope_scaling else None,
        "sparse_attention": cfg.sparse_attention(),
        "softmax_scale": cfg.softmax_scale,
        "bytes": nbytes,
        # MLA caches one latent (c_kv ‖ k_pe) per token per layer, shared by all heads (DSA: and an index key).
        "kv_cache_bytes_per_token": {
            dt: {"target": cfg.num_hidden_layers * cfg.cache_token_width * t.itemsize,
                 "mtp": cfg.num_nextn_predict_layers * cfg.cache_token_width * t.itemsize}
            for dt, t in KV_DTYPES.items()},
        "checkpoint_dtype": cfg.torch_dtype,
        "quantization": ({"method": cfg.quantization.method,
                          "weight_block_size": list(cfg.quantization.weight_block_size)}
                         if cfg.quantization else None),
    }


def _b(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"  # miniatures would all read 0.00B


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 2 ** 20:.2f} MiB"


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] → '0-2, 5'."""
    out: list[str] = []
    for i in indices:
        if out and i == int(out[-1].split("-")[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ", ".join(out) or "none"


def format_report(info: dict) -> str:
    p, lay, moe = info["parameters"], info["layers"], info["moe"]
    lines = [f"model: {info['model']} ({info['architecture']}, checkpoint dtype {info['checkpoint_dtype']}"
             + (f", {info['quantization']['method']} {info['quantization']['weight_block_size']} blocks"
                if info["quantization"] else "") + ")",
             f"parameters: target {_b(p['target'])} (embedding {_b(p['embedding'])}, lm_head {_b(p['lm_head'])}), "
             f"MTP {_b(p['mtp'])} (shares the embedding and lm_head), total {_b(p['total'])}",
             f"layers: {lay['num_hidden_layers']} target + MTP at {_ranges(lay['mtp_layers'])}; "
             f"dense {_ranges(lay['dense'])}; MoE {_ranges(lay['moe'])}"]
    if moe:
        act = moe["active_parameters_per_token"]
        lines.append(f"MoE: {moe['n_routed_experts']} routed experts, top-{moe['num_experts_per_tok']} "
                     f"(groups {moe['n_group']}, keep {moe['topk_group']}), {moe['n_shared_experts']} shared, "
                     f"intermediate {moe['moe_intermediate_size']}; active per token: target {_b(act['target'])}, "
                     f"MTP {_b(act['mtp'])}")
    rs = info["rope_scaling"]
    rope = f"YaRN ×{rs['factor']:g} over {rs['original_max_position_embeddings']} positions" if rs else "plain"
    lines.append(f"rope: {rope}; softmax scale {info['softmax_scale']:.4f}")
    if (sa := info["sparse_attention"]) is not None:
        shared = [i for i, t in enumerate(sa["indexer_types"]) if t == "shared"]
        lines.append(f"sparse attention: top-{sa['index_topk']} by a lightning indexer of {sa['index_n_heads']} × "
                     f"{sa['index_head_dim']} ({sa['indexer_rope']} RoPE); layers reusing an earlier top-k: "
                     f"{shared or 'none'}; draft steps share the first's: {sa['share_for_mtp']}")
    lines.append("weights:")
    for dt, b in info["bytes"].items():
        lines.append(f"  {dt:<9} target {_gib(b['target']):>12}   MTP {_gib(b['mtp']):>10}   "
                     f"total {_gib(b['target'] + b['mtp']):>12}")
    lines.append("KV cache per token (MLA latent):")
    for dt, b in info["kv_cache_bytes_per_token"].items():
        lines.append(f"  {dt:<9} target {b['target']:,} B   MTP {b['mtp']:,} B   "
                     f"({_gib((b['target'] + b['mtp']) * 1_000_000)} per 1M tokens)")
    return "\n".join(lines)


def add_inspect_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("inspect", help="size a model from its config.json (reads no weights)")
    p.add_argument("--model", type=lambda v: NAMED_MODELS.get(v, Path(v)), default=BUNDLED_MODEL_DIR,
                   help=f"checkpoint folder or one of {sorted(NAMED_MODELS)}; only config.json is read "
                        "(default: bundled)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=cmd_inspect)


def cmd_inspect(args: argparse.Namespace) -> int:
    info = inspect_model(args.model)
    print(json.dumps(info, indent=2) if args.json else format_report(info))
    return 0
