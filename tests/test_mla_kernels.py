"""The paged MLA attention seam: every kernel computes the gather reference's function (fp32, 1e-5), whatever
the block table's width and the block size, with ragged lengths, causal verify queries and pad rows."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from ascend_spec.graph import mla_kernels
from ascend_spec.graph.backends.base import clone_with_name
from ascend_spec.graph.mla_kernels import NPU_ATTENTION_KWARGS, gather_mla
from ascend_spec.graph.paging import PagedInputs, live_blocks
from ascend_spec.sync_counter import HostSyncCounter, suspended

from .conftest import npu_available
from .npu_standin import add_cache_write

C, R, H, BLOCK = 512, 64, 4, 16


def _batch(seq_lens: list[int], q: int, width: int, num_blocks: int = 96, seed: int = 0, block: int = BLOCK,
           heads: int = H):
    """A random latent cache pair, shuffled block tables ``[B, width]`` (dead entries → the null block 0), verify
    positions (each live row's last ``q``), host lengths."""
    g = torch.Generator().manual_seed(seed)
    kv_c = torch.randn(num_blocks, block, C, generator=g)
    kv_pe = torch.randn(num_blocks, block, R, generator=g)
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    table = torch.zeros(len(seq_lens), width, dtype=torch.long)
    used = 0
    for i, n in enumerate(seq_lens):
        k = -(-n // block)
        assert k <= width and used + k < num_blocks
        table[i, :k] = perm[used: used + k]
        used += k
    lens = torch.tensor(seq_lens)
    positions = (lens.view(-1, 1) - q + torch.arange(q)).clamp(min=0)
    q_lat = torch.randn(len(seq_lens), q, heads, C, generator=g) * 0.05
    q_pe = torch.randn(len(seq_lens), q, heads, R, generator=g) * 0.05
    slots = torch.full_like(positions, -1)
    return q_lat, q_pe, (kv_c, kv_pe), PagedInputs(positions, slots, table, lens, tuple(seq_lens))


CASES = [([40, 64, 17, 90, 33], 3), ([1, 200, 16], 1), ([5, 0, 48], 2), ([130, 0, 0, 7], 4)]  # 0: pad rows
#: (seq_lens, q, block size, table width): 16 as on CPU, 128 as vllm-ascend's MLA cache
NPU_CASES = [(lens, q, 16, 20) for lens, q in CASES] + [(lens, q, 128, 3) for lens, q in CASES]


def _live(seq_lens: list[int]) -> torch.Tensor:
    return torch.tensor(seq_lens) > 0


@pytest.mark.parametrize("seq_lens, q", CASES)
def test_trimmed_table_equals_full_width(seq_lens, q):
    """The CPU policy: a table trimmed to the live blocks gives what the full width gives."""
    q_lat, q_pe, cache, inp = _batch(seq_lens, q, width=20)
    full = gather_mla(q_lat, q_pe, cache, inp, 0.1)
    w = live_blocks(max(seq_lens), 20, BLOCK)
    trimmed = gather_mla(q_lat, q_pe, cache, inp._replace(block_table=inp.block_table[:, :w]), 0.1)
    live = _live(seq_lens)
    torch.testing.assert_close(trimmed[live], full[live], rtol=1e-5, atol=1e-5)


def test_reference_kernels_ignore_host_lengths():
    q_lat, q_pe, cache, inp = _batch([40, 64, 17], 3, width=20)
    for kernel in (gather_mla, mla_kernels.flex_mla):
        torch.testing.assert_close(kernel(q_lat, q_pe, cache, inp._replace(seq_lens_host=(1, 1, 1)), 0.1),
                                   kernel(q_lat, q_pe, cache, inp._replace(seq_lens_host=None), 0.1))


@pytest.mark.parametrize("seq_lens, q, block, width", NPU_CASES)
def test_flex_equals_gather(seq_lens, q, block, width):
    """FlexAttention over the whole pool with a block mask from the block table (what CUDA graphs replay)."""
    q_lat, q_pe, cache, inp = _batch(seq_lens, q, width=width, block=block)
    ref = gather_mla(q_lat, q_pe, cache, inp, 0.1)
    got = mla_kernels.flex_mla(q_lat, q_pe, cache, inp, 0.1)
    live = _live(seq_lens)
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
    inp = PagedInputs(*(t.cuda() for t in inp[:4]))
    ref = gather_mla(q_lat, q_pe, cache, inp, 0.1)
    got = torch.compile(kernel, fullgraph=True)(q_lat, q_pe, cache, inp, 0.1)
    live = torch.tensor(seq_lens, device="cuda") > 0
    torch.testing.assert_close(got[live], ref[live], rtol=1e-4, atol=1e-4)
    assert torch.isfinite(got).all()


def _fused_infer_attention_tnd(query, key, value, *, query_rope, key_rope, num_heads, num_key_value_heads,
                                input_layout, scale, block_table, block_size, actual_seq_lengths,
                                actual_seq_lengths_kv, atten_mask, sparse_mode):
    """``npu_fused_infer_attention_score`` as torch_npu 2.14's documentation describes it for MLA with a paged
    cache in ``TND_NTD``: query ``[T, N, D]`` whose rows belong to batch ``b`` between the cumulative query
    lengths ``actual_seq_lengths[b-1]`` and ``actual_seq_lengths[b]``; key/value ``[num_blocks, 1, block_size, D]``
    read through ``block_table[b]`` up to ``actual_seq_lengths_kv[b]`` (per batch, not cumulative, with a block
    table); ``sparse_mode=3`` is rightDownCausal (query row ``i`` of ``q_b`` sees keys ``< kv_b - q_b + i + 1``)
    and takes the optimised 2048 × 2048 lower-triangular mask; ``sparse_mode=0`` without a mask sees all
    ``kv_b`` keys. Output ``[N, T, D]``. A batch with no key gets zeros."""
    assert input_layout == "TND_NTD" and num_key_value_heads == 1 and query.dim() == 3 and value is key
    assert num_heads in (32, 64, 128) and query.shape[1] == query_rope.shape[1] == num_heads
    assert key.dim() == 4 and key.shape[1] == 1 and key.shape[2] == block_size == key_rope.shape[2]
    assert query.is_contiguous() and query_rope.is_contiguous() and key_rope.is_contiguous()
    assert block_table.dtype == torch.int32 and block_table.dim() == 2
    batch = len(actual_seq_lengths)
    assert len(actual_seq_lengths_kv) == batch == block_table.shape[0] and actual_seq_lengths[-1] == query.shape[0]
    assert all(type(n) is int for n in list(actual_seq_lengths) + list(actual_seq_lengths_kv)), "host ints only"
    if sparse_mode == 3:
        assert atten_mask is not None and atten_mask.shape == (2048, 2048) and atten_mask.dtype == torch.int8
        assert torch.equal(atten_mask, torch.ones(2048, 2048, dtype=torch.int8).triu(1))
    else:
        assert sparse_mode == 0 and atten_mask is None
    out = query.new_zeros(num_heads, query.shape[0], value.shape[-1])
    start = 0
    for b, (end, kv_len) in enumerate(zip(actual_seq_lengths, actual_seq_lengths_kv)):
        q_b = end - start
        assert block_table.shape[1] * block_size >= kv_len
        if kv_len:
            blocks = block_table[b].long()
            k_lat = key[blocks, 0].reshape(-1, key.shape[-1])[:kv_len]
            k_rope = key_rope[blocks, 0].reshape(-1, key_rope.shape[-1])[:kv_len]
            s = (torch.einsum("tnd,kd->ntk", query[start:end], k_lat)
                 + torch.einsum("tnd,kd->ntk", query_rope[start:end], k_rope)) * scale  # [N, q_b, kv]
            if sparse_mode == 3:
                hidden = torch.arange(kv_len).view(1, -1) > (kv_len - q_b + torch.arange(q_b)).view(-1, 1)
                s = s.masked_fill(hidden, float("-inf"))
            out[:, start:end] = s.softmax(-1) @ k_lat
        start = end
    return out, query.new_zeros(1)


def _fake_torch_npu(calls: list) -> types.ModuleType:
    """A stand-in ``torch_npu`` whose op records the keyword names it was called with and computes under
    ``suspended()`` (its own reads are not the kernel's)."""

    def op(query, key, value, **kwargs):
        calls.append(tuple(kwargs))
        with suspended():
            return _fused_infer_attention_tnd(query, key, value, **kwargs)

    fake = types.ModuleType("torch_npu")
    fake.npu_fused_infer_attention_score = op
    return add_cache_write(fake)


@pytest.mark.parametrize("seq_lens, q, block, width", NPU_CASES)
def test_npu_kernel_composition_with_fake_torch_npu(monkeypatch, seq_lens, q, block, width):
    """The NPU path's plumbing (TND rows per request, host KV lengths, one block table row per request, the
    causal verify block) reproduces the reference, without one host read."""
    calls: list = []
    monkeypatch.setitem(sys.modules, "torch_npu", _fake_torch_npu(calls))
    q_lat, q_pe, cache, inp = _batch(seq_lens, q, width=width, block=block)
    with HostSyncCounter(strict=True):
        got = mla_kernels.npu_mla(q_lat, q_pe, cache, inp, 0.1)
    ref = gather_mla(q_lat, q_pe, cache, inp, 0.1)
    live = _live(seq_lens)
    assert got.shape == ref.shape
    torch.testing.assert_close(got[live], ref[live], rtol=1e-5, atol=1e-5)
    assert torch.isfinite(got).all()
    assert calls == [NPU_ATTENTION_KWARGS]


def test_npu_kernel_pads_heads_for_the_op(monkeypatch):
    """3 heads reach the op as 32 (its smallest head count with rope inputs); the padding is cut off again."""
    monkeypatch.setitem(sys.modules, "torch_npu", _fake_torch_npu([]))
    q_lat, q_pe, cache, inp = _batch([40, 64, 17], 3, width=20, heads=3)
    got = mla_kernels.npu_mla(q_lat, q_pe, cache, inp, 0.1)
    torch.testing.assert_close(got, gather_mla(q_lat, q_pe, cache, inp, 0.1), rtol=1e-5, atol=1e-5)


def test_npu_kernel_checks_can_fail(monkeypatch):
    """The stand-in and the comparison notice wrong host lengths and a missing causal mask."""
    monkeypatch.setitem(sys.modules, "torch_npu", _fake_torch_npu([]))
    q_lat, q_pe, cache, inp = _batch([40, 64, 17], 3, width=20)
    ref = gather_mla(q_lat, q_pe, cache, inp, 0.1)
    wrong = mla_kernels.npu_mla(q_lat, q_pe, cache, inp._replace(seq_lens_host=(40, 63, 17)), 0.1)
    assert not torch.allclose(wrong, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(AssertionError, match="host ints"):
        mla_kernels.npu_mla(q_lat, q_pe, cache, inp._replace(seq_lens_host=tuple(inp.seq_lens)), 0.1)
    # without host lengths the kernel reads them from the device: a host sync, counted as one
    with pytest.raises(RuntimeError, match="host sync"), HostSyncCounter(strict=True):
        mla_kernels.npu_mla(q_lat, q_pe, cache, inp._replace(seq_lens_host=None), 0.1)
    fused = torch.cat(cache, dim=-1)
    with pytest.raises(ValueError, match="kv_layout 'pair'"):
        mla_kernels.npu_mla(q_lat, q_pe, (fused[..., :C], fused[..., C:]), inp, 0.1)


#: The wheel's schema (torch_npu 2.14 ``npu_native_functions_by_codegen.yaml``) reduced to the arguments we pass.
_STAND_IN_SCHEMA = (
    "npu_fused_infer_attention_score(Tensor query, Tensor key, Tensor value, *, Tensor? atten_mask=None, "
    "SymInt[]? actual_seq_lengths=None, SymInt[]? actual_seq_lengths_kv=None, Tensor? block_table=None, "
    "Tensor? query_rope=None, Tensor? key_rope=None, int num_heads=1, float scale=1.0, str input_layout=\"BSH\", "
    "int num_key_value_heads=0, int sparse_mode=0, int block_size=0) -> (Tensor, Tensor)")


def _stand_in_custom_op():
    """The stand-in registered as a dispatcher op with the wheel's ``SymInt[]`` lengths, so that Dynamo traces
    the call as it traces ``torch.ops.npu.npu_fused_infer_attention_score``."""
    ns = "ascend_spec_test"
    if not hasattr(getattr(torch.ops, ns), "npu_fused_infer_attention_score"):
        lib = torch.library.Library(ns, "FRAGMENT")
        lib.define(_STAND_IN_SCHEMA)
        _stand_in_custom_op.lib = lib  # keep the registration alive

        def cpu(query, key, value, **kw):
            kw = {k: (list(v) if k.startswith("actual_seq") else v) for k, v in kw.items()}
            return _fused_infer_attention_tnd(query, key, value, **kw)

        lib.impl("npu_fused_infer_attention_score", cpu, "CPU")

        def meta(query, key, value, *, num_heads, **kw):
            return query.new_empty(num_heads, query.shape[0], value.shape[-1]), query.new_empty(1)

        torch.library.register_fake(f"{ns}::npu_fused_infer_attention_score", meta, lib=lib)
    return getattr(torch.ops, ns).npu_fused_infer_attention_score


@pytest.mark.parametrize("dynamic_lengths", [True, False])
def test_npu_kernel_compiled_host_lengths_are_graph_inputs(monkeypatch, dynamic_lengths):
    """Compiled with ``dynamic=False`` (torchair's per-shape graphs), the host lengths reach the graph as SymInt
    inputs once their sources are marked dynamic: one graph serves every length and nothing in it reads a
    tensor's value; left static, each new length compiles a graph (the ints are baked in)."""
    fake = types.ModuleType("torch_npu")
    fake.npu_fused_infer_attention_score = _stand_in_custom_op()
    monkeypatch.setitem(sys.modules, "torch_npu", add_cache_write(fake))
    graphs: list = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def step(q_lat, q_pe, kv_c, kv_pe, positions, table, seq_lens, lens_host: list[int]):
        inp = PagedInputs(positions, torch.full_like(positions, -1), table, seq_lens, tuple(lens_host))
        return mla_kernels.npu_mla(q_lat, q_pe, (kv_c, kv_pe), inp, 0.1)

    # its own code object: Dynamo's cache for this test only, nothing else reset
    step = clone_with_name(step, f"npu_mla_step_{'dynamic' if dynamic_lengths else 'static'}_lengths")
    compiled = torch.compile(step, backend=backend, fullgraph=True, dynamic=False)
    sources = r"L\['lens_host'\]\[\d+\]" if dynamic_lengths else ""
    with torch.compiler.config.patch(dynamic_sources=sources):
        for seq_lens in ([40, 64, 17, 0], [41, 65, 0, 0], [90, 3, 33, 120]):
            q_lat, q_pe, (kv_c, kv_pe), inp = _batch(seq_lens, 3, width=8, seed=0)
            got = compiled(q_lat, q_pe, kv_c, kv_pe, inp.positions, inp.block_table, inp.seq_lens, seq_lens)
            live = _live(seq_lens)
            torch.testing.assert_close(got[live], gather_mla(q_lat, q_pe, (kv_c, kv_pe), inp, 0.1)[live],
                                       rtol=1e-5, atol=1e-5)
    if not dynamic_lengths:
        assert len(graphs) == 3
        return
    assert len(graphs) == 1
    (gm,) = graphs
    symbolic = [n for n in gm.graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("example_value"),
                                                                                   torch.SymInt)]
    assert len(symbolic) == 4
    reads = [n for n in gm.graph.nodes if (n.op == "call_method" and n.target in ("item", "tolist", "cpu", "numpy"))
             or (n.op == "call_function" and "_local_scalar_dense" in str(n.target))]
    assert reads == []


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
@pytest.mark.parametrize("seq_lens, q, block, width", NPU_CASES)
def test_npu_kernel_on_npu(seq_lens, q, block, width):
    """The real op in bf16 (it takes no fp32) against the fp32 reference on the same bf16 values."""
    q_lat, q_pe, (kv_c, kv_pe), inp = _batch(seq_lens, q, width=width, block=block)
    q_lat, q_pe, kv_c, kv_pe = (t.bfloat16() for t in (q_lat, q_pe, kv_c, kv_pe))
    ref = gather_mla(q_lat.float(), q_pe.float(), (kv_c.float(), kv_pe.float()), inp, 0.1)
    dev = "npu"
    got = mla_kernels.npu_mla(q_lat.to(dev), q_pe.to(dev), (kv_c.to(dev), kv_pe.to(dev)),
                              PagedInputs(*(t.to(dev) for t in inp[:4]), inp.seq_lens_host), 0.1).cpu()
    live = _live(seq_lens)
    assert torch.isfinite(got.float()).all()
    torch.testing.assert_close(got[live].float(), ref[live], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("seq_lens, q", CASES)
def test_gather_in_bf16_rounds_once_as_vllms_cpu_kernels(seq_lens, q):
    """bf16 inputs: scores, softmax and the weighted sum accumulate in fp32 and the output is rounded once, as
    vLLM's CPU MLA kernels do (its decode kernel and the prefill SDPA upcast): the error against an fp64 reference
    on the same bf16 values is that one rounding's, not the several of bf16 products (about 5x as large)."""
    q_lat, q_pe, (kv_c, kv_pe), inp = _batch(seq_lens, q, width=20)
    bf = [t.bfloat16() for t in (q_lat, q_pe, kv_c, kv_pe)]
    got = gather_mla(bf[0], bf[1], (bf[2], bf[3]), inp, 0.1)
    assert got.dtype == torch.bfloat16
    ref = gather_mla(*(t.double() for t in bf[:2]), tuple(t.double() for t in bf[2:]), inp, 0.1)
    live = _live(seq_lens)
    err = (got.double() - ref)[live].abs().max().item()
    rounding = (ref.bfloat16().double() - ref)[live].abs().max().item()
    assert err <= 1.5 * rounding, f"bf16 attention error {err:.2e} against one rounding's {rounding:.2e}"
