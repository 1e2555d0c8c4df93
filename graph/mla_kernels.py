"""The paged MLA attention seam: latent queries against each request's cached blocks.
Kernels computing one function: :func:`gather_mla` (the reference), :func:`flex_mla` and :func:`npu_mla`.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F

from .paging import PagedInputs


#: The latent cache of one layer: ``kv_c [num_blocks, block_size, C]`` and ``kv_pe [num_blocks, block_size, R]``.
#: the cache as every kernel takes it: (kv_c [N, block, C], kv_pe [N, block, R]) (graph.latent_cache.latent_parts)
CacheParts = tuple[torch.Tensor, torch.Tensor]


class MLAKernel(Protocol):
    def __call__(self, q_lat: torch.Tensor, q_pe: torch.Tensor, cache: CacheParts, inp: PagedInputs,
                 scale: float) -> torch.Tensor:
        """``q_lat [B, Q, H, C]``, ``q_pe [B, Q, H, R]``, ``cache = (kv_c, kv_pe)`` → ``o_lat [B, Q, H, C]``."""
        ...


def gather_mla(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: CacheParts, inp: PagedInputs,
               scale: float) -> torch.Tensor:
    kv_c, kv_pe = cache
    table = inp.block_table.long()
    # Scores, softmax and the weighted sum in float32, rounded once to the query's dtype: vLLM's CPU MLA kernels
    # accumulate bf16 attention in fp32 too, and bf16 einsums would round every score, weight and partial sum.
    ctx_c = kv_c[table].flatten(1, 2).float()  # [B, M*block, C]
    ctx_pe = kv_pe[table].flatten(1, 2).float()  # [B, M*block, R]
    scores = torch.einsum("bqhc,bkc->bqhk", q_lat.float(), ctx_c) + torch.einsum("bqhr,bkr->bqhk", q_pe.float(),
                                                                                   ctx_pe)
    scores = scores * scale
    key_pos = torch.arange(ctx_c.shape[1], device=q_lat.device)
    visible = (key_pos.view(1, 1, -1) <= inp.positions.unsqueeze(-1)) & (
        key_pos.view(1, 1, -1) < inp.seq_lens.view(-1, 1, 1))
    # Key 0 stays visible so that pad rows (seq_len 0) get a finite, discarded result, not NaN.
    visible = visible | (key_pos == 0).view(1, 1, -1)
    scores = scores.masked_fill(~visible.unsqueeze(2), float("-inf"))
    # softmax, its denominator a matmul: inductor specialises a compiled sum on its length (past 4,096 terms it
    # switches to a chunked accumulator and guards on it), which would make the context length a graph key.
    e = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    denom = torch.matmul(e, torch.ones(e.shape[-1], 1, dtype=e.dtype, device=e.device))
    return torch.einsum("bqhk,bkc->bqhc", e / denom, ctx_c).to(q_lat.dtype)


def flex_mla(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: CacheParts, inp: PagedInputs,
             scale: float) -> torch.Tensor:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    b, q_len, h, c = q_lat.shape
    kv_c, kv_pe = cache
    num_blocks, block = kv_c.shape[0], kv_c.shape[1]
    # the whole pool: kv block i is physical block i
    keys = torch.cat([kv_c, kv_pe], dim=-1).view(1, 1, num_blocks * block, -1)
    table = inp.block_table.long()
    m = table.shape[1]
    # Each row visits its live blocks only (at least one, so pad rows stay finite); dead table entries point
    # at the null block and are never visited.
    live_blocks = ((inp.seq_lens + block - 1) // block).clamp(min=1, max=m)
    kv_indices = torch.cat([table, table.new_zeros(b, num_blocks - m)], dim=1) if num_blocks > m else table
    # physical block → logical block of each row, for the causal mask (-1: not this row's)
    logical = torch.full((b, num_blocks), -1, dtype=torch.long, device=table.device).scatter(
        1, table, torch.arange(m, device=table.device).expand(b, m))
    positions, seq_lens = inp.positions, inp.seq_lens

    def mask_mod(bi: Any, hi: Any, qi: Any, ki: Any) -> Any:
        pos = logical[bi, ki // block] * block + ki % block
        return ((pos <= positions[bi, qi]) & (pos < seq_lens[bi]) & (logical[bi, ki // block] >= 0)) | (
            (seq_lens[bi] == 0) & (ki == 0))

    mask = BlockMask.from_kv_blocks(live_blocks.view(b, 1, 1).int(), kv_indices.view(b, 1, 1, -1).int(),
                                    BLOCK_SIZE=(q_len, block), mask_mod=mask_mod,
                                    seq_lengths=(q_len, num_blocks * block))
    query = torch.cat([q_lat, q_pe], dim=-1).transpose(1, 2)  # [B, H, Q, C + R]
    out = flex_attention(query, keys, kv_c.view(1, 1, num_blocks * block, c), block_mask=mask, scale=scale,
                         enable_gqa=True)
    return out.transpose(1, 2)


#: torch_npu's fused attention: every argument name we pass (the contract test checks them against the wheel).
NPU_ATTENTION_OP = "npu_fused_infer_attention_score"
NPU_ATTENTION_KWARGS = ("query_rope", "key_rope", "num_heads", "num_key_value_heads", "input_layout", "scale",
                        "block_table", "block_size", "actual_seq_lengths", "actual_seq_lengths_kv", "atten_mask",
                        "sparse_mode")
#: torchair's own registration of the op (``torch.ops.air.*``, ``torchair/ops/_npu_fused_infer_attention_score.py``)
#: with ``Tensor?`` lengths: its GE converter feeds them to the graph's FusedInferAttentionScore as they are, and its
#: eager kernels only raise (GE mode, ``max-autotune``, only)
NPU_DEVICE_LENGTHS_OP = "npu_fused_infer_attention_score"
#: query ``[T, N, D]`` (T = all requests' tokens), output ``[N, T, D]``: vllm-ascend's speculative MLA decode layout
NPU_INPUT_LAYOUT = "TND_NTD"
#: the op's rightDownCausal mode takes this fixed-size "optimised" mask (1 = masked), never a per-batch one
NPU_CAUSAL_MASK_SIZE = 2048


def npu_mla(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: CacheParts, inp: PagedInputs,
            scale: float) -> torch.Tensor:
    """All ``Q`` verify tokens of a request in one pass over its context: TND rows grouped per request by
    cumulative query lengths, KV length per request from ``inp.seq_lens_host``, causal inside the verify block
    by the op's rightDownCausal mode (``sparse_mode=3``; a single query token needs no mask: ``sparse_mode=0``)."""
    import torch_npu  # needs CANN; imported on the NPU path only

    b, q_len, h, c = q_lat.shape
    kv_c, kv_pe = cache
    if not (kv_c.is_contiguous() and kv_pe.is_contiguous()):
        raise ValueError("npu_mla takes contiguous nope / rope caches (vllm-ascend's layout); this cache is a single "
                         "576-wide one: allocate it as a pair (kv_layout 'pair', --kv-layout pair)")
    # Callers that hold the lengths on the host pass them. Where none does (the draft chain's steps 2..K, whose
    # lengths follow acceptance), the device read below is a host sync inside the graph: counted, and refused by
    # strict graphs, never hidden. A GE graph's draft chain takes them as a tensor instead (``kv_lens_on_device``).
    device_lens = inp.kv_lens_on_device
    kv_lens = (None if device_lens else
               list(inp.seq_lens_host) if inp.seq_lens_host is not None else inp.seq_lens.tolist())
    num_blocks, block = kv_c.shape[0], kv_c.shape[1]
    # With rope inputs the op takes 32, 64 or 128 query heads (torch_npu's docs); vllm-ascend pads to the next
    # power of two. Padded heads get a discarded result.
    h_op = max(32, 1 << (h - 1).bit_length())
    query = q_lat.reshape(b * q_len, h, c)
    query_rope = q_pe.reshape(b * q_len, h, -1)
    if h_op != h:
        query = F.pad(query, (0, 0, 0, h_op - h))
        query_rope = F.pad(query_rope, (0, 0, 0, h_op - h))
    causal = q_len > 1
    mask = (torch.ones(NPU_CAUSAL_MASK_SIZE, NPU_CAUSAL_MASK_SIZE, dtype=torch.int8, device=q_lat.device).triu(1)
            if causal else None)
    table = inp.block_table.to(torch.int32)
    if causal:
        # A query block may end up to Q - 1 keys past max_model_len, past the table: the columns that covers point
        # at block 0, whose keys only the inert queries there see.
        table = F.pad(table, (0, -(-(q_len - 1) // block)))
    key = kv_c.view(num_blocks, 1, block, c)  # (blocknum, KV_N, blocksize, D): KV_N = 1, the same memory
    q_lens: list[int] | torch.Tensor = [q_len * (i + 1) for i in range(b)]
    fia = torch_npu.npu_fused_infer_attention_score
    if device_lens:
        # torchair's op of the same arguments with Tensor lengths (both of them: its schema has no int lists)
        fia = getattr(torch.ops.air, NPU_DEVICE_LENGTHS_OP)
        q_lens = torch.arange(1, b + 1, dtype=torch.int64, device=q_lat.device) * q_len
        kv_lens = inp.seq_lens.to(torch.int64)
    out, _ = fia(
        query.contiguous(), key, key,
        query_rope=query_rope.contiguous(), key_rope=kv_pe.view(num_blocks, 1, block, kv_pe.shape[-1]),
        num_heads=h_op, num_key_value_heads=1, input_layout=NPU_INPUT_LAYOUT, scale=scale,
        block_table=table, block_size=block,
        actual_seq_lengths=q_lens, actual_seq_lengths_kv=kv_lens,
        atten_mask=mask, sparse_mode=3 if causal else 0)
    return out[:h].view(h, b, q_len, c).permute(1, 2, 0, 3)  # NTD -> [B, Q, H, C]


KERNELS: dict[str, MLAKernel] = {"gather": gather_mla, "flex": flex_mla, "npu": npu_mla}
#: kernels that read ``PagedInputs.seq_lens_host``: callers pass host lengths to these only (a compiled graph
#: that took ints it never reads would guard on them)
HOST_LENGTH_KERNELS = frozenset({"npu"})
