"""Build a model from a checkpoint folder of any family we draft (or save one), with one clear error listing each
problem."""
from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch
from torch import nn

from .checkpoint import (SCALE_SUFFIX, WEIGHT_DTYPES, CheckpointFiles, Slot, WeightLoadError, checkpoint_layout,
                         dequantize_fp8_block, expert_count_problems, hf_state_dict, quantize_fp8_block,
                         save_tensors)
from .config import DTYPES, ConfigError, ModelConfig
from .families import build_model, config_from_dir
from .family import MtpModel
from .layers import RotaryEmbedding

__all__ = ["WeightLoadError", "load_model", "save_model", "resolve_dtype", "mtp_parameter",
           "parameter_part"]

Part = Literal["all", "mtp"]
#: Linear weights that DeepSeek-V3's fp8 checkpoints store quantised (router, norms, embedding, head stay bf16).
FP8_LINEARS = ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj",
               "up_proj", "down_proj", "wq_b", "wk")
MAX_LISTED_PROBLEMS = 20


def resolve_dtype(dtype: str | torch.dtype | None, cfg: ModelConfig) -> torch.dtype:
    """The run dtype: the argument, else the checkpoint's ``torch_dtype`` (fp8 checkpoints run in bfloat16)."""
    if dtype is None:
        return torch.bfloat16 if cfg.quantization is not None and cfg.torch_dtype == "float32" else cfg.dtype
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ConfigError(f"dtype={dtype}; allowed: {list(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r}; allowed: {list(DTYPES)}")
    return DTYPES[dtype]


def parameter_part(name: str, cfg: ModelConfig) -> str:
    """Where a parameter belongs: ``embedding``, ``lm_head``, ``mtp`` (layers from ``num_hidden_layers`` on) or
    ``target`` (the other layers and the final norm)."""
    if name == "model.embed_tokens.weight":
        return "embedding"
    if name == "lm_head.weight":
        return "lm_head"
    if name.startswith("model.layers."):
        return "mtp" if int(name.split(".")[2]) >= cfg.num_hidden_layers else "target"
    return "target"


def mtp_parameter(name: str, cfg: ModelConfig) -> bool:
    """Parameters an MTP-only load materialises: the MTP layer(s), plus the embedding and head they share."""
    return parameter_part(name, cfg) != "target"


def load_model(model_dir: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None,
               part: Part = "all") -> MtpModel:
    """Build the model from ``config.json`` and fill it from the safetensors files by HF name.

    ``part="mtp"`` materialises only what drafting needs (the MTP layer(s), embedding, lm_head) and opens only
    the shards that hold them; the target layers stay on the meta device. fp8 block-quantised weights are
    dequantised tensor by tensor into ``dtype`` (default: the checkpoint's ``torch_dtype``).
    """
    model_dir = Path(model_dir)
    cfg = config_from_dir(model_dir)
    run_dtype = resolve_dtype(dtype, cfg)
    with torch.device("meta"):
        model = build_model(cfg)
    model.to(run_dtype)  # on meta: free; MoE gate biases stay fp32
    files = CheckpointFiles(model_dir)
    slots, aliases = checkpoint_layout(model, cfg)
    wanted = {n: s for n, s in slots.items() if part == "all" or mtp_parameter(s.param, cfg)}
    _raise_on_problems(model_dir, files, slots, aliases, wanted)

    params = dict(model.named_parameters())
    for pname in sorted({s.param for s in wanted.values()}):
        module_name, _, leaf = pname.rpartition(".")
        meta = params[pname]
        module = model.get_submodule(module_name)
        module._parameters[leaf] = nn.Parameter(torch.empty(meta.shape, dtype=meta.dtype, device=device),
                                                requires_grad=False)
    params = dict(model.named_parameters())
    for name, slot in wanted.items():
        _fill(params[slot.param], slot, _read(files, name, cfg))
    rope = RotaryEmbedding.from_config(cfg).to(device)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.cos_cached, module.sin_cached = rope.cos_cached, rope.sin_cached
    return model.eval()


def _raise_on_problems(model_dir: Path, files: CheckpointFiles, slots: dict[str, Slot],
                       aliases: dict[str, tuple[int, ...]], wanted: dict[str, Slot]) -> None:
    present = set(files.names)
    surplus_experts = expert_count_problems(files.names, slots)  # reported once per layer, not per tensor
    problems = list(surplus_experts.values())
    for name in files.names:
        base = name[: -len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else name
        if base in slots or base in aliases:
            continue
        if any(name.startswith(prefix + ".") for prefix in surplus_experts):
            continue
        problems.append(f"unexpected tensor {name!r} in {files.file_of[name]}")
    problems += [f"missing tensor {name!r} (expected shape {list(slot.shape)})"
                 for name, slot in wanted.items() if name not in present]
    for name, slot in wanted.items():
        if name in present:
            shape = files.shape(name)
            if shape != slot.shape:
                problems.append(f"shape mismatch for {name!r}: expected {list(slot.shape)}, found {list(shape)}")
            if files.dtype(name) not in WEIGHT_DTYPES:
                problems.append(f"tensor {name!r} is stored as {files.dtype(name)}; allowed: {list(WEIGHT_DTYPES)}")
    if problems:
        shown = problems[:MAX_LISTED_PROBLEMS]
        if len(problems) > len(shown):
            shown.append(f"... and {len(problems) - len(shown)} more")
        raise WeightLoadError(f"checkpoint {model_dir} does not match its config.json:\n  " + "\n  ".join(shown))


def _read(files: CheckpointFiles, name: str, cfg: ModelConfig) -> torch.Tensor:
    t = files.read(name)
    if t.dtype != torch.float8_e4m3fn:
        return t
    if cfg.quantization is None:
        raise WeightLoadError(f"tensor {name!r} is float8_e4m3fn but config.json has no quantization_config "
                              "(expected quant_method 'fp8' with weight_block_size)")
    scale_name = name + SCALE_SUFFIX
    if scale_name not in files.file_of:
        raise WeightLoadError(f"tensor {name!r} is float8_e4m3fn but the checkpoint has no {scale_name!r}")
    return dequantize_fp8_block(t, files.read(scale_name), cfg.quantization.weight_block_size, name)


def _fill(param: torch.Tensor, slot: Slot, value: torch.Tensor) -> None:
    with torch.no_grad():
        target = param if slot.expert is None else param[slot.expert]
        if slot.rows is not None:
            target = target[slot.rows]
        target.copy_(value.to(param.dtype))


def save_model(model: MtpModel, model_dir: str | Path, dtype: torch.dtype = torch.float32,
               max_shard_bytes: int | None = None, fp8_block: tuple[int, int] | None = None) -> Path:
    """Write the weights under HF names: ``model.safetensors``, or shards plus an index.

    ``fp8_block`` writes DeepSeek-style block-fp8 linear weights with ``*_scale_inv`` (the config.json must then
    carry ``quantization_config``: see :func:`fp8_quantization_config`).
    """
    model_dir = Path(model_dir)
    tensors = hf_state_dict(model, model.cfg, dtype)
    if fp8_block is not None:
        for name in [n for n in tensors if n.startswith("model.layers.")
                     and n.rsplit(".", 2)[-2] in FP8_LINEARS and n.endswith(".weight")]:
            tensors[name], tensors[name + SCALE_SUFFIX] = quantize_fp8_block(tensors[name], fp8_block)
    save_tensors(tensors, model_dir, max_shard_bytes)
    return model_dir


def fp8_quantization_config(block: tuple[int, int] = (128, 128)) -> dict:
    """``quantization_config`` as DeepSeek-V3's config.json has it."""
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(block)}
