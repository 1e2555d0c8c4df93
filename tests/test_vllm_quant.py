"""A quantised DeepSeek-V3 MoE checkpoint in vLLM's CPU engine: our drafter runs vLLM's quantised layers.

``bundled-moe-w8a8`` is ``bundled-moe`` (the trained MoE + YaRN miniature, so drafts get accepted) written as
compressed-tensors W8A8-int8 by ``tools/make_tiny_moe.py --w8a8``: int8 per-channel weights and dynamic per-token
int8 activations for the attention projections, dense MLP and shared experts (vLLM's CompressedTensorsW8A8Int8,
oneDNN), routed experts float. It is the format vLLM-CPU 0.32 runs on a CPU without AMX: block-fp8 linears need AMX,
and every quantised FusedMoE kernel on CPU needs AMX or Arm. Our drafter holds no weight: the quantised MTP
attention, the shared experts and vLLM's whole MoE run vLLM's modules inside our draft graph.

On an AMX CPU vLLM runs these int8 linears with its AMX kernel, which takes bf16 / fp16 activations only, so the
engines run in the dtype this host's kernels take (:func:`~tests.conftest.vllm_cpu_dtype`): bf16 there, float32
elsewhere.

DeepSeek-V3's own block-fp8, and vllm-ascend's W8A8 target beside a float MTP layer, are tested where they run
(``cuda`` / ``npu`` markers).
"""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from safetensors.torch import load_file

from ascend_spec_tools.tiny_models import W8A8_QMAX, w8a8_from

from .conftest import TIE_BY_DTYPE, assert_moe_counters_close, npu_available, run_harness, vllm_cpu_dtype
from .test_vllm_moe import GRAPH, RUN, assert_same_or_tie, ok

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm (vllm-cpu 0.32.0) is not installed")

DTYPE = vllm_cpu_dtype()
RUN_W8A8 = {**RUN, "llm": {**RUN["llm"], "dtype": DTYPE}}
CONFIGS = [
    {"name": "none", "drafter": "none", "logprobs": 2, **RUN_W8A8},
    {"name": "vllm_k2", "drafter": "vllm", "k": 2, **RUN_W8A8},
    {"name": "ours_k2", "drafter": "ours", "k": 2, "graph": GRAPH, **RUN_W8A8},
]


@pytest.fixture(scope="module")
def w8a8_ckpt(moe_ckpts, tmp_path_factory):
    return w8a8_from(moe_ckpts["bundled-moe"], tmp_path_factory.mktemp("w8a8") / "bundled-moe-w8a8")


def test_w8a8_checkpoint_layout(w8a8_ckpt, moe_ckpts):
    """int8 [out, in] + fp32 [out, 1] scales on the quantised linears, within ±63; experts and eh_proj float;
    dequantised weights within half a step of the originals."""
    src = load_file(moe_ckpts["bundled-moe"] / "model.safetensors")
    q = load_file(w8a8_ckpt / "model.safetensors")
    cfg = json.loads((w8a8_ckpt / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == "int-quantized"
    quantised = [n for n, t in q.items() if t.dtype == torch.int8]
    assert any(".self_attn.o_proj." in n for n in quantised) and any(".shared_experts." in n for n in quantised)
    mtp = json.loads((w8a8_ckpt / "config.json").read_text())["num_hidden_layers"]
    assert f"model.layers.{mtp}.self_attn.o_proj.weight" in quantised  # the MTP layer is quantised too
    for name in quantised:
        scale = q[name[: -len("weight")] + "weight_scale"]
        assert scale.shape == (q[name].shape[0], 1) and scale.dtype == torch.float32, name
        assert int(q[name].abs().max()) <= W8A8_QMAX, name
        assert (q[name].float() * scale - src[name]).abs().max() <= scale.max() / 2 + 1e-7, name
    for name, t in q.items():
        if ".mlp.experts." in name or "eh_proj" in name or "kv_b_proj" in name:
            assert t.dtype == src[name].dtype and torch.equal(t, src[name]), name


def test_w8a8_rejects_a_quantised_source(w8a8_ckpt, tmp_path):
    with pytest.raises(ValueError, match="already quantised"):
        w8a8_from(w8a8_ckpt, tmp_path / "twice")


def test_w8a8_float_mtp_keeps_the_mtp_layer_float(moe_ckpts, tmp_path):
    ckpt = w8a8_from(moe_ckpts["bundled-moe"], tmp_path / "float-mtp", float_mtp=True)
    hf = json.loads((ckpt / "config.json").read_text())
    mtp = f"model.layers.{hf['num_hidden_layers']}."
    q = load_file(ckpt / "model.safetensors")
    assert any(t.dtype == torch.int8 for t in q.values())
    assert all(t.dtype != torch.int8 for n, t in q.items() if n.startswith(mtp)) and f"{mtp}self_attn.o_proj.weight" in q
    assert any(mtp.replace(".", "\\.") in i for i in hf["quantization_config"]["ignore"])


@pytest.mark.vllm
@needs_vllm
def test_ours_drafts_on_vllm_quantised_layers(w8a8_ckpt, tmp_path):
    runs = run_harness(CONFIGS, w8a8_ckpt, tmp_path)
    none, theirs, ours = ok(runs, "none"), ok(runs, "vllm_k2"), ok(runs, "ours_k2")
    (stats,) = ours["drafter"]
    assert stats["quantization"] == "compressed-tensors", stats  # vLLM loaded it quantised
    assert stats["drafter"] == "ascend_spec" and stats["graph_calls"] > 0 and stats["fallback_calls"] == 0, stats
    assert stats["weights_owned_bytes"] == 0, stats  # no dequantised shadow, no copy
    assert_same_or_tie(none, ours["tokens"], f"ours K=2 vs vLLM no-spec (W8A8, {DTYPE})", TIE_BY_DTYPE[DTYPE])
    assert ours["tokens"] == theirs["tokens"]
    assert theirs["metrics"]["spec_decode_num_accepted_tokens"] > 0
    assert_moe_counters_close(ours, theirs, "ours vs vLLM's drafter (W8A8)")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
                    reason="block-fp8 (DeepSeek-V3's format) runs in vLLM on CUDA; CPUs without AMX lack its kernels")
def test_block_fp8_moe_drafts_on_vllm_layers(tmp_path):
    """DeepSeek-V3's block-fp8 (128×128 weight_scale_inv, experts quantised too): ours == vLLM's drafter."""
    from ascend_spec_tools.tiny_models import write_checkpoint

    ckpt = write_checkpoint(tmp_path / "fp8", "moe-e16-k4", fp8=True)
    runs = run_harness([{"name": n, "drafter": d, "k": 2, "graph": GRAPH, **RUN}
                        for n, d in (("vllm_k2", "vllm"), ("ours_k2", "ours"))], ckpt, tmp_path)
    ours, theirs = ok(runs, "ours_k2"), ok(runs, "vllm_k2")
    (stats,) = ours["drafter"]
    assert stats["quantization"] == "fp8" and stats["weights_owned_bytes"] == 0, stats
    assert ours["tokens"] == theirs["tokens"]


@pytest.mark.npu
@pytest.mark.skipif(not npu_available(), reason="vllm-ascend's W8A8 target runs on an Ascend NPU (torch_npu, CANN)")
def test_w8a8_target_with_float_mtp_layer_on_npu(moe_ckpts, tmp_path):
    """vllm-ascend's deployment: a W8A8 target beside a float MTP layer; our drafter runs vllm-ascend's layers."""
    ckpt = w8a8_from(moe_ckpts["bundled-moe"], tmp_path / "w8a8-float-mtp", float_mtp=True)
    runs = run_harness([{"name": n, "drafter": d, "k": 2, "graph": GRAPH, **RUN}
                        for n, d in (("vllm_k2", "vllm"), ("ours_k2", "ours"))], ckpt, tmp_path)
    ours, theirs = ok(runs, "ours_k2"), ok(runs, "vllm_k2")
    assert ours["drafter"][0]["weights_owned_bytes"] == 0
    assert ours["tokens"] == theirs["tokens"]
