import json
from pathlib import Path

import pytest
import torch

from ascend_spec.graph.config import ModelConfig
from ascend_spec.graph.model import DeepseekV3ForCausalLM
from ascend_spec.graph.weights import save_model
from ascend_spec.models import BUNDLED_MODEL_DIR

TINY = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                   kv_lora_rank=512, qk_nope_head_dim=16, qk_rope_head_dim=64, v_head_dim=16,
                   max_position_embeddings=256, eos_token_id=0)


def random_model(cfg: ModelConfig = TINY, seed: int = 0) -> DeepseekV3ForCausalLM:
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
            else:
                p.uniform_(0.8, 1.2)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """A random-weight checkpoint in the bundled format (config.json + model.safetensors)."""
    d = tmp_path_factory.mktemp("tiny_ckpt")
    save_model(random_model(), d)
    (d / "config.json").write_text(json.dumps(TINY.to_hf_dict()))
    return d


@pytest.fixture(scope="session")
def bundled_dir() -> Path:
    if not (BUNDLED_MODEL_DIR / "model.safetensors").is_file():
        pytest.fail(f"bundled checkpoint missing in {BUNDLED_MODEL_DIR}; run tools/train_tiny.py")
    return BUNDLED_MODEL_DIR


@pytest.fixture(scope="session")
def moe_ckpts(tmp_path_factory):
    """The tiny MoE + YaRN checkpoints of tools/make_tiny_moe.py, written once per session: name → folder.

    The random presets, plus ``bundled-moe`` (the bundled trained model made MoE + YaRN: drafts get accepted).
    """
    from ascend_spec.tiny_models import PRESETS, moe_from_bundled, write_checkpoint

    root = tmp_path_factory.mktemp("tiny_moe")
    return {**{name: write_checkpoint(root / name, name) for name in PRESETS},
            "bundled-moe": moe_from_bundled(root / "bundled-moe")}


def generate_without_recompiles(engine, prompts, max_tokens):
    """Generate under ``fail_on_recompile``, recording the batch size of every step: (stats, batch sizes seen)."""
    from ascend_spec.sampling import SamplingParams

    seen: set[int] = set()
    step = engine._step

    def tracking(running, *args):
        seen.add(len(running))
        return step(running, *args)

    engine._step = tracking
    try:
        with torch.compiler.set_stance("fail_on_recompile"):
            _, stats, _ = engine.generate(prompts, SamplingParams(), max_tokens)
    finally:
        del engine._step
    return stats, seen
