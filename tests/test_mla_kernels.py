"""The paged MLA attention seam: every kernel computes the gather reference's function (fp32, 1e-5), whatever
the block table's width, with ragged lengths, causal verify queries and pad rows."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from ascend_spec.graph import mla_kernels
from ascend_spec.graph.mla_kernels import NPU_ATTENTION_KWARGS, PagedInputs, gather_mla, live_blocks

from .conftest import npu_available

C, R, H, BLOCK = 512, 64, 4, 16


def _batch(seq_lens: list[int], q: int, width: int, num_blocks: int = 96, seed: int = 0):
    """A random cache, shuffled block tables ``[B, width]`` (dead entries → the null block 0), verify positions."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(num_blocks, BLOCK, C + R, generator=g)
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    table = torch.zeros(len(seq_lens), width, dtype=torch.long)
    used = 0
    for i, n in enumerate(seq_lens):
        k = live_blocks(n, width, BLOCK, minimum=1) if n else 0
        table[i, :k] = perm[used: used + k]
        used += k
    lens = torch.tensor(seq_lens)
    positions = (lens.view(-1, 1) - q + torch.arange(q)).clamp(min=0)
    q_lat = torch.randn(len(seq_lens), q, H, C, generator=g) * 0.05
    q_pe = torch.randn(len(seq_lens), q, H, R, generator=g) * 0.05
    slots = torch.full_like(positions, -1)
    return q_lat, q_pe, (cache[..., :C], cache[..., C:]), PagedInputs(positions, slots, table, lens)


CASES = [([40, 64, 17, 90, 33], 3), ([1, 200, 16], 1), ([5, 0, 48], 2)]  # 0: a pad row


@pytest.mark.parametrize("seq_lens, q", CASES)
def test_trimmed_table_equals_full_width(seq_lens, q):
    """The CPU policy: a table trimmed to the live blocks gives what the full width gives."""
    q_lat, q_pe, cache, inp = _batch(seq_lens, q, width=20)
    full = gather_mla(q_lat, q_pe, cache, inp, 0.1)
    w = live_blocks(max(seq_lens), 20, BLOCK)
    trimmed = gather_mla(q_lat, q_pe, cache, inp._replace(block_table=inp.block_table[:, :w]), 0.1)
    live = torch.tensor(seq_lens) > 0
    torch.testing.assert_close(trimmed[live], full[live], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seq_lens, q", CASES)
def test_flex_equals_gather(seq_lens, q):
    """FlexAttention over the whole pool with a block mask from the block table (what CUDA graphs replay)."""
    q_lat, q_pe, cache, inp = _batch(seq_lens, q, width=20)
    ref = gather_mla(q_lat, q_pe, cache, inp, 0.1)
    got = mla_kernels.flex_mla(q_lat, q_pe, cache, inp, 0.1)
    live = torch.tensor(seq_lens) > 0
    torch.testing.assert_close(got[live], ref[live], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(got).all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("seq_lens, q", CASES)
def test_cuda_kernel_compiled_equals_eager(seq_lens, q):
    """What a CUDA graph replays: the CUDA backend's kernel compiled whole-graph (Triton), full-width table."""
    from ascend_spec.graph.backends.inductor import InductorBackend

    kernel = mla_kernels.KERNELS[InductorBackend(torch.device("cuda")).attention_kernel]
    q_lat, q_pe, cache, inp = _batch(seq_lens, q, width=20)
    q_lat, q_pe, cache = q_lat.cuda(), q_pe.cuda(), tuple(t.cuda() for t in cache)
    inp = PagedInputs(*(t.cuda() for t in inp))
    ref = gather_mla(q_lat, q_pe, cache, inp, 0.1)
    got = torch.compile(kernel, fullgraph=True)(q_lat, q_pe, cache, inp, 0.1)
    live = torch.tensor(seq_lens, device="cuda") > 0
    torch.testing.assert_close(got[live], ref[live], rtol=1e-4, atol=1e-4)
    assert torch.isfinite(got).all()


def _fake_fused_infer_attention(calls: list):
    """``npu_fused_infer_attention_score`` per torch_npu's documentation for BNSD with a block table: query
    ``[N, H, 1, C]``, key/value ``[num_blocks, 1, block, C]`` (paged), ``query_rope``/``key_rope`` the rope parts,
    row ``n`` attends to its first ``actual_seq_lengths_kv[n]`` keys through ``block_table[n]``."""

    def op(query, key, value, *, query_rope, key_rope, num_heads, num_key_value_heads, input_layout, scale,
           block_table, block_size, actual_seq_lengths_kv, atten_mask, sparse_mode):
        calls.append(("npu_fused_infer_attention_score", 3,
                      ("query_rope", "key_rope", "num_heads", "num_key_value_heads", "input_layout", "scale",
                       "block_table", "block_size", "actual_seq_lengths_kv", "atten_mask", "sparse_mode")))
        assert input_layout == "BNSD" and num_key_value_heads == 1 and atten_mask is None and sparse_mode == 0
        assert isinstance(actual_seq_lengths_kv, list) and block_table.dtype == torch.int32
        outs = []
        for n, kv_len in enumerate(actual_seq_lengths_kv):
            blocks = block_table[n].long()
            k_lat = key[blocks, 0].reshape(-1, key.shape[-1])[:kv_len]
            k_rope = key_rope[blocks, 0].reshape(-1, key_rope.shape[-1])[:kv_len]
            v = value[blocks, 0].reshape(-1, value.shape[-1])[:kv_len]
            s = (query[n, :, 0] @ k_lat.T + query_rope[n, :, 0] @ k_rope.T) * scale  # [H, kv_len]
            outs.append((s.softmax(-1) @ v).unsqueeze(1))
        return torch.stack(outs), None

    return op


@pytest.mark.parametrize("seq_lens, q", CASES)
def test_npu_kernel_composition_with_fake_torch_npu(monkeypatch, seq_lens, q):
    """The NPU path's plumbing (one query row per verify token, KV lengths ending at each query's position,
    the block table per row) reproduces the reference. The real kernel's numerics need an NPU (``npu`` marker)."""
    calls: list = []
    monkeypatch.setitem(sys.modules, "torch_npu",
                        types.SimpleNamespace(npu_fused_infer_attention_score=_fake_fused_infer_attention(calls)))
    q_lat, q_pe, cache, inp = _batch(seq_lens, q, width=20)
    got = mla_kernels.npu_mla(q_lat, q_pe, cache, inp, 0.1)
    ref = gather_mla(q_lat, q_pe, cache, inp, 0.1)
    live = torch.tensor(seq_lens) > 0
    torch.testing.assert_close(got[live], ref[live], rtol=1e-5, atol=1e-5)
    assert [c[2] for c in calls] == [NPU_ATTENTION_KWARGS]


def test_kernel_choice_per_backend():
    from ascend_spec.graph.backends.eager import EagerBackend
    from ascend_spec.graph.backends.inductor import InductorBackend
    from ascend_spec.graph.backends.torchair import TorchairBackend

    assert TorchairBackend.attention_kernel == "npu"
    # compiled FlexAttention is wrong or refused for MLA's shapes on both (graph.mla_kernels)
    assert InductorBackend(torch.device("cuda")).attention_kernel == "gather"
    assert InductorBackend(torch.device("cpu")).attention_kernel == "gather"
    assert EagerBackend.attention_kernel == "gather"
    assert {TorchairBackend.attention_kernel, "flex", "gather"} <= set(mla_kernels.KERNELS)


def test_unknown_kernel_is_refused(trained_dir):
    from ascend_spec.graph.weights import load_model

    model = load_model(trained_dir)
    with pytest.raises(ValueError, match=r"attention kernel 'paged'; allowed: \['flex', 'gather', 'npu'\]"):
        model.set_attention_kernel("paged")
    model.set_attention_kernel("flex")
    assert model.model.layers[0].self_attn.kernel is mla_kernels.flex_mla


@pytest.mark.npu
@pytest.mark.skipif(not npu_available(), reason="needs an Ascend NPU with torch_npu and CANN")
def test_npu_kernel_on_npu():
    q_lat, q_pe, cache, inp = _batch([40, 64, 17], 3, width=8)
    ref = gather_mla(q_lat, q_pe, cache, inp, 0.1)
    dev = "npu"
    got = mla_kernels.npu_mla(q_lat.to(dev), q_pe.to(dev), tuple(t.to(dev) for t in cache),
                              PagedInputs(*(t.to(dev) for t in inp)), 0.1).cpu()
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)
