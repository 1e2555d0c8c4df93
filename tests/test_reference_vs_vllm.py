"""Our reference decoding (no speculation, greedy) against vLLM's CPU engine on the bundled checkpoint."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from ascend_spec.config import EngineConfig, TorchairGraphConfig
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
                  enforce_eager=True, attention_backend="CPU_MLA", seed=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=False))
        print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
""")


@pytest.mark.vllm
def test_greedy_no_spec_matches_vllm(bundled_dir, tmp_path):
    pytest.importorskip("vllm")
    tok = TextTokenizer(bundled_dir)
    prompts = [tok.encode(p) for p in PROMPTS]
    script = tmp_path / "run_vllm.py"
    script.write_text(VLLM_SCRIPT)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_PLUGINS="")
    proc = subprocess.run([sys.executable, str(script), str(bundled_dir), json.dumps(prompts), str(MAX_TOKENS)],
                          capture_output=True, text=True, env=env, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    theirs = json.loads(lines[-1][len("RESULT "):])

    eng = load_engine(bundled_dir, EngineConfig(max_model_len=256, max_num_seqs=4, speculative=None,
                                                graph=TorchairGraphConfig(enabled=False, backend="eager")))
    ours = [o.token_ids for o in eng.generate(prompts, SamplingParams(), MAX_TOKENS)[0]]
    assert ours == theirs
