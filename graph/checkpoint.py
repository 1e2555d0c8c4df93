"""DeepSeek-V3 checkpoints on disk: safetensors (single file or sharded through ``model.safetensors.index.json``),
HF tensor names mapped onto our parameters, DeepSeek's block-fp8 weights.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import ModelConfig

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = (torch.float8_e4m3fn,)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
#: safetensors dtype codes a weight may be stored in (float weights, fp8 with block scales)
WEIGHT_DTYPES = ("BF16", "F16", "F32", "F64", "F8_E4M3")

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class WeightLoadError(ValueError):
    """A checkpoint whose tensors do not match the model built from its config."""


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one checkpoint tensor goes: ``param[expert, rows]`` (expert and rows None for plain tensors)."""

    param: str
    shape: tuple[int, ...]
    expert: int | None = None
    rows: slice | None = None


class CheckpointFiles:
    """Tensor names → shard files, with shapes and data read on demand."""

    def __init__(self, model_dir: str | Path) -> None:
        self.dir = Path(model_dir)
        index = self.dir / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise WeightLoadError(f"{index}: no 'weight_map' of tensor name → shard file")
            self.file_of: dict[str, str] = dict(weight_map)
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise WeightLoadError(f"no *.safetensors file (nor {INDEX_FILE}) in {self.dir}")
            self.file_of = {}
            for path in files:
                with _open_safetensors(path) as f:  # reads the header only
                    self.file_of.update({name: path.name for name in f.keys()})
        self._open: dict[str, object] = {}

    @property
    def names(self) -> list[str]:
        return list(self.file_of)

    def _handle(self, name: str):
        fname = self.file_of[name]
        if fname not in self._open:
            path = self.dir / fname
            if not path.is_file():
                raise WeightLoadError(f"tensor {name!r} is mapped to {fname}, which is not in {self.dir}")
            self._open[fname] = _open_safetensors(path)
        return self._open[fname]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """safetensors' dtype code, e.g. ``F32``, ``BF16``, ``F8_E4M3``."""
        return self._handle(name).get_slice(name).get_dtype()

    def read(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)


def _open_safetensors(path: Path):
    """``safe_open`` with a truncated or foreign file reported as one error naming the file."""
    try:
        return safe_open(str(path), framework="pt")
    except Exception as exc:  # safetensors raises its own SafetensorError (not exported) or OSError
        raise WeightLoadError(f"{path}: not a complete safetensors file ({exc}); re-download or re-save it") from exc


def checkpoint_layout(model: torch.nn.Module, cfg: ModelConfig) -> tuple[dict[str, Slot], dict[str, tuple[int, ...]]]:
    """(HF name → :class:`Slot` for every tensor the model needs, HF names accepted but not read → shape).

    Not read: the MTP layer's own ``embed_tokens`` / ``shared_head.head``: it drafts with the target's (vLLM too).
    """
    slots: dict[str, Slot] = {}
    for name, p in model.named_parameters():
        shape = tuple(p.shape)
        if name.endswith(".mlp.experts.w13_weight"):
            prefix, inter = name[: -len(".w13_weight")], shape[1] // 2
            for e in range(shape[0]):
                slots[f"{prefix}.{e}.gate_proj.weight"] = Slot(name, (inter, shape[2]), e, slice(0, inter))
                slots[f"{prefix}.{e}.up_proj.weight"] = Slot(name, (inter, shape[2]), e, slice(inter, 2 * inter))
        elif name.endswith(".mlp.experts.w2_weight"):
            prefix = name[: -len(".w2_weight")]
            for e in range(shape[0]):
                slots[f"{prefix}.{e}.down_proj.weight"] = Slot(name, shape[1:], e)
        else:
            slots[name] = Slot(name, shape)
    aliases: dict[str, tuple[int, ...]] = {}
    for i in range(cfg.num_hidden_layers, cfg.num_layers_with_mtp):
        aliases[f"model.layers.{i}.embed_tokens.weight"] = (cfg.vocab_size, cfg.hidden_size)
        aliases[f"model.layers.{i}.shared_head.head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    return slots, aliases


def dequantize_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                         name: str = "weight") -> torch.Tensor:
    """DeepSeek's block fp8: ``w[i·b0:(i+1)·b0, j·b1:(j+1)·b1] · scale_inv[i, j]`` → float32."""
    rows, cols = weight.shape
    expected = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if tuple(scale_inv.shape) != expected:
        raise WeightLoadError(f"{name}{SCALE_SUFFIX} has shape {list(scale_inv.shape)}; a {list(weight.shape)} "
                              f"weight in {list(block)} blocks needs {list(expected)}")
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * scale


def quantize_fp8_block(weight: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`dequantize_fp8_block` (per-block absmax scaling), for writing test checkpoints."""
    rows, cols = weight.shape
    nb = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    padded = torch.zeros(nb[0] * block[0], nb[1] * block[1], dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(nb[0], block[0], nb[1], block[1])
    scale_inv = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)  # [nb0, nb1]
    q = (blocks / scale_inv[:, None, :, None]).view_as(padded)[:rows, :cols]
    return q.to(torch.float8_e4m3fn).contiguous(), scale_inv


def hf_state_dict(model: torch.nn.Module, cfg: ModelConfig,
                  dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Our parameters under DeepSeek-V3's HF names (experts unstacked, the MTP layer's shared copies written)."""
    slots, aliases = checkpoint_layout(model, cfg)
    params = dict(model.named_parameters())
    out: dict[str, torch.Tensor] = {}
    for name, slot in slots.items():
        t = params[slot.param].detach()
        if slot.expert is not None:
            t = t[slot.expert]
            if slot.rows is not None:
                t = t[slot.rows]
        keep_fp32 = name.endswith("e_score_correction_bias")
        out[name] = t.to("cpu", torch.float32 if keep_fp32 else dtype).clone().contiguous()
    for name in aliases:
        source = "model.embed_tokens.weight" if name.endswith("embed_tokens.weight") else "lm_head.weight"
        out[name] = out[source].clone()
    return out


def save_tensors(tensors: dict[str, torch.Tensor], model_dir: str | Path, max_shard_bytes: int | None = None) -> None:
    """One ``model.safetensors``, or shards of at most ``max_shard_bytes`` plus ``model.safetensors.index.json``."""
    model_dir = Path(model_dir)
    if max_shard_bytes is None:
        save_file(tensors, str(model_dir / SINGLE_FILE), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(model_dir / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (model_dir / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                   indent=1))


def expert_count_problems(names: list[str], slots: dict[str, Slot]) -> dict[str, str]:
    """Checkpoint experts beyond the config's ``n_routed_experts``: experts prefix → one line per layer."""
    beyond: dict[str, int] = {}
    for name in names:
        m = _EXPERT.match(name)
        if m and name not in slots:
            beyond[m.group(1)] = max(beyond.get(m.group(1), -1), int(m.group(2)))
    problems = {}
    for prefix, top in sorted(beyond.items()):
        configured = sum(1 for n in slots if n.startswith(prefix + ".") and n.endswith(".down_proj.weight"))
        problems[prefix] = (f"{prefix} holds expert ids up to {top} ({top + 1} experts) but config.json's "
                            f"n_routed_experts={configured}")
    return problems
