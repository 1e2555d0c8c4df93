"""Load and save DeepSeek-V3 checkpoints (safetensors, HF names) with one clear error per problem."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import ModelConfig
from .model import DeepseekV3ForCausalLM

WEIGHTS_FILE = "model.safetensors"


class WeightLoadError(ValueError):
    """A checkpoint whose tensors do not match the model built from its config."""


def _checkpoint_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no *.safetensors file in {model_dir}")
    return files


def load_model(model_dir: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> DeepseekV3ForCausalLM:
    """Build the model from ``config.json`` and fill it from the safetensors files by HF name."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(cfg)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}

    tensors: dict[str, torch.Tensor] = {}
    seen: set[str] = set()
    problems: list[str] = []
    for path in _checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name not in expected:
                    problems.append(f"unexpected tensor {name!r} in {path.name}")
                    continue
                seen.add(name)
                shape = tuple(f.get_slice(name).get_shape())
                if shape != expected[name]:
                    problems.append(f"shape mismatch for {name!r}: expected {list(expected[name])}, found {list(shape)}")
                    continue
                tensors[name] = f.get_tensor(name)
    problems += [f"missing tensor {name!r} (expected shape {list(shape)})"
                 for name, shape in expected.items() if name not in seen]
    if problems:
        raise WeightLoadError(f"checkpoint {model_dir} does not match its config.json:\n  " + "\n  ".join(problems))

    model = model.to_empty(device=device)
    model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=True, assign=False)
    _init_rope_buffers(model, device)
    return model.to(dtype=dtype).eval()


def _init_rope_buffers(model: DeepseekV3ForCausalLM, device: str | torch.device) -> None:
    """Non-persistent RoPE tables were left on the meta device by ``to_empty``; recompute them."""
    from .layers import RotaryEmbedding

    cfg = model.cfg
    fresh = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.max_position_embeddings, cfg.rope_theta).to(device)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.cos_cached = fresh.cos_cached
            module.sin_cached = fresh.sin_cached


def save_model(model: DeepseekV3ForCausalLM, model_dir: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write ``model.safetensors`` under HF names; tied tensors are stored as separate copies, as in HF."""
    path = Path(model_dir) / WEIGHTS_FILE
    state = {k: v.detach().to("cpu", dtype).clone().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path), metadata={"format": "pt"})
    return path
