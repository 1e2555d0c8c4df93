"""torch_npu's ops as ``torch.ops.npu.*`` on CPU, declared with the torch_npu 2.14.0 wheel's own schemas, and
torchair's Tensor-length attention as ``torch.ops.air.*``, declared with the schema torchair's source defines.

Traced graphs then hold ``npu.<op>.default`` nodes, as on an NPU, and run: each op's CPU kernel computes the
formula of the op's documentation (``test_mla_kernels._fused_infer_attention_tnd``, the MoE formulas of
``test_torchair_contract``), its fake kernel gives the shapes. Nothing here says how the real kernels compute.
"""
from __future__ import annotations

import types
from typing import Any, Callable

import torch

from ascend_spec.graph import moe_npu

#: the ops our NPU path calls, beyond the MoE ones (the DSA family's two last)
EXTRA_OPS = ("npu_fused_infer_attention_score", "npu_scatter_nd_update", "npu_lightning_indexer",
             "npu_sparse_flash_attention")
#: where torchair defines ``torch.ops.air.npu_fused_infer_attention_score`` (``lib.define``) and its GE converter
AIR_ATTENTION_SOURCE = "torch_npu/dynamo/torchair/ops/_npu_fused_infer_attention_score.py"
_LIB: torch.library.Library | None = None
_AIR_LIB: torch.library.Library | None = None


def air_schemas(source: str) -> dict[str, str]:
    """Op name → schema of every ``lib.define("...")`` of a torchair ``ops/`` source (the ``air`` namespace)."""
    import ast

    schemas = {}
    for call in ast.walk(ast.parse(source)):
        if (isinstance(call, ast.Call) and ast.unparse(call.func) == "lib.define" and call.args
                and isinstance(call.args[0], ast.Constant)):
            text = " ".join(call.args[0].value.split())
            schemas[text.split("(", 1)[0]] = text
    return schemas


def _fake_kernels() -> dict[str, Callable[..., Any]]:
    def fia(query, key, value, *args, num_heads=1, **kwargs):
        return query.new_empty(num_heads, query.shape[0], value.shape[-1]), query.new_empty(1)

    def gating(x, k, *args, **kwargs):
        t, e = x.shape
        return x.new_empty(t, k), x.new_empty(t, k, dtype=torch.int32), x.new_empty(t, e, dtype=torch.float32)

    def init_routing(x, row_idx, expert_idx, active_num):
        n = row_idx.numel()
        return (x.new_empty(min(x.shape[0], active_num) * row_idx.shape[1], x.shape[1]),
                row_idx.new_empty(n, dtype=torch.int32), row_idx.new_empty(n, dtype=torch.int32))

    def expert_tokens(sorted_rows, num_expert):
        return sorted_rows.new_empty(num_expert, dtype=torch.int32)

    def grouped_matmul(x, weight, *args, **kwargs):
        return [x[0].new_empty(x[0].shape[0], weight[0].shape[2])]

    def swiglu(x, dim=-1):
        shape = list(x.shape)
        shape[dim] //= 2
        return x.new_empty(shape)

    def finalize(rows, skip1, skip2, bias, scales, src_to_dst, export, *args):
        return rows.new_empty(scales.shape[0], rows.shape[1])

    def scatter_nd(self, indices, updates):
        return torch.empty_like(self)

    def lightning_indexer(query, key, weights, *args, sparse_count=2048, **kwargs):
        return query.new_empty(query.shape[0], 1, sparse_count, dtype=torch.int32), query.new_empty(0)

    def sparse_flash_attention(query, key, value, sparse_indices, scale_value, *args, **kwargs):
        return query.new_empty(query.shape[0], query.shape[1], key.shape[-1]), query.new_empty(0), query.new_empty(0)

    return {"npu_lightning_indexer": lightning_indexer, "npu_sparse_flash_attention": sparse_flash_attention,
            "npu_fused_infer_attention_score": fia, "npu_moe_gating_top_k": gating,
            "npu_moe_init_routing": init_routing, "npu_moe_compute_expert_tokens": expert_tokens,
            "npu_grouped_matmul": grouped_matmul, "npu_swiglu": swiglu, "npu_moe_finalize_routing": finalize,
            "npu_scatter_nd_update": scatter_nd}


def _bind(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Every argument of ``npu::name`` by its schema name, defaults included."""
    schema = getattr(torch.ops.npu, name).default._schema
    named = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    return named | dict(zip([a.name for a in schema.arguments], args)) | kwargs


def _cpu_kernels() -> dict[str, Callable[..., Any]]:
    from .test_mla_kernels import _fused_infer_attention_tnd
    from .test_torchair_contract import _fake_torch_npu

    documented = _fake_torch_npu([])

    def fia(query, key, value, **kwargs):
        kwargs = _bind("npu_fused_infer_attention_score", (query, key, value), kwargs)
        used = {k: kwargs[k] for k in ("query_rope", "key_rope", "num_heads", "num_key_value_heads", "input_layout",
                                       "scale", "block_table", "block_size", "actual_seq_lengths",
                                       "actual_seq_lengths_kv", "atten_mask", "sparse_mode")}
        used["actual_seq_lengths"] = [int(n) for n in used["actual_seq_lengths"]]
        used["actual_seq_lengths_kv"] = [int(n) for n in used["actual_seq_lengths_kv"]]
        return _fused_infer_attention_tnd(query, key, value, **used)

    def scatter_nd(self, indices, updates):
        out = self.clone()
        out[indices[:, 0]] = updates
        return out

    kernels: dict[str, Callable[..., Any]] = {"npu_fused_infer_attention_score": fia,
                                              "npu_scatter_nd_update": scatter_nd,
                                              "npu_lightning_indexer": _lightning_indexer_tnd,
                                              "npu_sparse_flash_attention": _sparse_flash_attention_tnd}
    return kernels | _moe_kernels(documented)


def _request_rows(cum_q: torch.Tensor, kv_lens: torch.Tensor):
    """``(request, its query rows, row index within the block, the block's length, its KV length)`` of a TND batch."""
    start = 0
    for b, (end, kv_len) in enumerate(zip(cum_q.tolist(), kv_lens.tolist())):
        for i, t in enumerate(range(start, end)):
            yield b, t, i, end - start, kv_len
        start = end


def _paged_rows(cache: torch.Tensor, table: torch.Tensor, b: int, positions: torch.Tensor) -> torch.Tensor:
    """Rows ``positions`` of request ``b`` in a ``PA_BSND`` cache ``[blocks, block, 1, width]``."""
    block = cache.shape[1]
    return cache[table[b, positions // block].long(), positions % block, 0]


def _lightning_indexer_tnd(query, key, weights, *, actual_seq_lengths_query=None, actual_seq_lengths_key=None,
                           block_table=None, layout_query="BSND", layout_key="BSND", sparse_count=2048,
                           sparse_mode=3, pre_tokens=0, next_tokens=0, return_value=False):
    """torch_npu's documented lightning indexer (TND query, PA_BSND keys, sparse_mode 3): row i of a block of Q
    ending at KV length L scores positions ``0 .. L - Q + i`` as ``Σ_h w_h · relu(q_h · k)``, keeps the
    ``sparse_count`` best (highest first), ``-1`` after. Ties (undocumented for the op) go to the earlier position."""
    assert (layout_query, layout_key, sparse_mode) == ("TND", "PA_BSND", 3), (layout_query, layout_key, sparse_mode)
    for lens in (actual_seq_lengths_query, actual_seq_lengths_key, block_table):
        assert lens.dtype == torch.int32, lens.dtype
    out = torch.full((query.shape[0], 1, sparse_count), -1, dtype=torch.int32)
    for b, t, i, q_len, kv_len in _request_rows(actual_seq_lengths_query, actual_seq_lengths_key):
        visible = kv_len - q_len + i + 1
        if visible <= 0:
            continue
        keys = _paged_rows(key, block_table, b, torch.arange(visible)).float()  # [S, d]
        scores = (weights[t].float().unsqueeze(-1) * torch.relu(query[t].float() @ keys.T)).sum(0)
        order = scores.sort(descending=True, stable=True).indices[:sparse_count]
        out[t, 0, : order.numel()] = order.to(torch.int32)
    return out, query.new_empty(0)


def _sparse_flash_attention_tnd(query, key, value, sparse_indices, scale_value, *, block_table=None,
                                actual_seq_lengths_query=None, actual_seq_lengths_kv=None, query_rope=None,
                                key_rope=None, sparse_block_size=1, layout_query="BSND", layout_kv="BSND",
                                sparse_mode=3, pre_tokens=0, next_tokens=0, attention_mode=0,
                                return_softmax_lse=False, sinks=None):
    """torch_npu's documented sparse flash attention in MLA's absorbed mode (``attention_mode`` 2): each TND row
    attends the positions its indices list up to the first ``-1``, those past its causal limit skipped, over the
    nope cache (keys and values) with the rope parts added to the scores; a row with none gives zeros."""
    assert (layout_query, layout_kv, sparse_mode, attention_mode, sparse_block_size) == (
        "TND", "PA_BSND", 3, 2, 1), (layout_query, layout_kv, sparse_mode, attention_mode, sparse_block_size)
    assert sparse_indices.dtype == torch.int32 and actual_seq_lengths_kv.dtype == torch.int32
    out = torch.zeros(query.shape[0], query.shape[1], key.shape[-1], dtype=query.dtype)
    for b, t, i, q_len, kv_len in _request_rows(actual_seq_lengths_query, actual_seq_lengths_kv):
        idx = sparse_indices[t, 0].long()
        stop = int((idx < 0).nonzero()[0]) if (idx < 0).any() else idx.numel()
        idx = idx[:stop]
        idx = idx[idx < kv_len - q_len + i + 1]
        if idx.numel() == 0:
            continue
        nope = _paged_rows(key, block_table, b, idx).float()  # [k, C]
        rope = _paged_rows(key_rope, block_table, b, idx).float()
        scores = (query[t].float() @ nope.T + query_rope[t].float() @ rope.T) * scale_value  # [N, k]
        out[t] = (scores.softmax(-1) @ nope).to(query.dtype)
    return out, query.new_empty(0), query.new_empty(0)


def _air_fia(query, key, value, **kwargs):
    """torchair's op: the same attention, its lengths ``Tensor`` (int64, one per request) instead of ints."""
    from .test_mla_kernels import _fused_infer_attention_tnd

    schema = torch.ops.air.npu_fused_infer_attention_score.default._schema
    named = {a.name: a.default_value for a in schema.arguments if a.has_default_value()} | kwargs
    used = {k: named[k] for k in ("query_rope", "key_rope", "num_heads", "num_key_value_heads", "input_layout",
                                  "scale", "block_table", "block_size", "atten_mask", "sparse_mode")}
    for name in ("actual_seq_lengths", "actual_seq_lengths_kv"):
        lens = named[name]
        assert isinstance(lens, torch.Tensor) and lens.dtype == torch.int64 and lens.dim() == 1, (name, lens)
        used[name] = [int(n) for n in lens.tolist()]
    return _fused_infer_attention_tnd(query, key, value, **used)


def _moe_kernels(documented: Any) -> dict[str, Callable[..., Any]]:
    kernels: dict[str, Callable[..., Any]] = {}
    for name, spec in moe_npu.NPU_MOE_CALLS.items():
        def kernel(*args, _name=name, _spec=spec, **kwargs):
            named = _bind(_name, args, kwargs)
            return getattr(documented, _name)(*[named[n] for n in _spec.positional],
                                              **{n: named[n] for n in _spec.keyword})
        kernels[name] = kernel
    return kernels


def register(schemas: dict[str, str], air: dict[str, str] | None = None) -> types.ModuleType:
    """Declare the ops (once per process) from ``schemas`` (op → the wheel's ``func`` string) and, given ``air``
    (:func:`air_schemas` of ``AIR_ATTENTION_SOURCE``), torchair's Tensor-length attention; returns a ``torch_npu``
    stand-in module exposing the ``npu`` ops."""
    global _LIB, _AIR_LIB
    if air is not None and _AIR_LIB is None:
        _AIR_LIB = torch.library.Library("air", "DEF")
        _AIR_LIB.define(air["npu_fused_infer_attention_score"])
        _AIR_LIB.impl("npu_fused_infer_attention_score", _air_fia, "CPU")
        torch.library.register_fake("air::npu_fused_infer_attention_score",
                                    _fake_kernels()["npu_fused_infer_attention_score"], lib=_AIR_LIB)
    names = [*moe_npu.NPU_MOE_CALLS, *EXTRA_OPS]
    if _LIB is None:
        _LIB = torch.library.Library("npu", "DEF")
        fakes, cpus = _fake_kernels(), _cpu_kernels()
        for name in names:
            _LIB.define(schemas[name])
            _LIB.impl(name, cpus[name], "CPU")
            torch.library.register_fake(f"npu::{name}", fakes[name], lib=_LIB)
    module = types.ModuleType("torch_npu")
    for name in names:
        setattr(module, name, getattr(torch.ops.npu, name))
    # the in-place scatter, as the eager path calls it (a graph holds the out-of-place op)
    module.npu_scatter_nd_update_ = lambda self, indices, updates: self.index_copy_(0, indices[:, 0], updates)
    return module


def add_cache_write(module: types.ModuleType) -> types.ModuleType:
    """Give a hand-made ``torch_npu`` stand-in the cache write the NPU path calls (``latent_cache._write_npu``:
    ``npu_scatter_nd_update`` in graphs, its in-place form eagerly), as plain torch ops (no wheel schema needed)."""
    module.npu_scatter_nd_update = lambda self, indices, updates: self.index_copy(0, indices[:, 0], updates)
    module.npu_scatter_nd_update_ = lambda self, indices, updates: self.index_copy_(0, indices[:, 0], updates)
    return module
