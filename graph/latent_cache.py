"""The paged latent KV cache as the graphs address it: its layout and block size are data, read off the tensors.
One cached token is ``[c_kv ; k_pe]``, stored ``single`` (one tensor) or as a ``pair`` (nope, rope) of any block size.
"""
from __future__ import annotations

from typing import Union

import torch

#: a latent KV cache: one tensor, or a (nope, rope) pair
LatentCache = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]
LAYOUTS = ("single", "pair")
#: the name ``single`` had before: users' configs keep working
LAYOUT_ALIASES = {"fused": "single"}
#: the engine's default block size (vLLM's CPU_MLA takes 16 only)
DEFAULT_BLOCK_SIZE = 16


def canonical_layout(layout: str) -> str:
    """``layout`` with an alias resolved; ValueError naming the allowed values for an unknown one."""
    layout = LAYOUT_ALIASES.get(layout, layout)
    if layout not in LAYOUTS:
        raise ValueError(f"kv_layout={layout!r}; allowed: {list(LAYOUTS)} (alias: 'fused' for 'single')")
    return layout


def layout_of(cache: LatentCache) -> str:
    return "single" if isinstance(cache, torch.Tensor) else "pair"


def block_size_of(cache: LatentCache) -> int:
    return int((cache if isinstance(cache, torch.Tensor) else cache[0]).shape[1])


def latent_parts(cache: LatentCache, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kv_c [N, block, C], kv_pe [N, block, R])``: the pair itself, or two views of a single-tensor cache."""
    if isinstance(cache, torch.Tensor):
        return cache[..., :kv_lora_rank], cache[..., kv_lora_rank:]
    return cache


def cache_tensors(cache: LatentCache) -> tuple[torch.Tensor, ...]:
    """The tensors that hold the cache (what a CUDA graph must see at a static address)."""
    return (cache,) if isinstance(cache, torch.Tensor) else tuple(cache)


def allocate_latent_cache(layout: str, num_blocks: int, block_size: int, kv_lora_rank: int, rope_dim: int,
                          dtype: torch.dtype, device: torch.device | str) -> LatentCache:
    layout = canonical_layout(layout)
    if layout == "single":
        return torch.zeros(num_blocks, block_size, kv_lora_rank + rope_dim, dtype=dtype, device=device)
    if layout == "pair":
        return (torch.zeros(num_blocks, block_size, kv_lora_rank, dtype=dtype, device=device),
                torch.zeros(num_blocks, block_size, rope_dim, dtype=dtype, device=device))


def same_shape(a: LatentCache, b: LatentCache) -> bool:
    return [t.shape for t in cache_tensors(a)] == [t.shape for t in cache_tensors(b)]


def describe(cache: LatentCache) -> str:
    return " + ".join(str(list(t.shape)) for t in cache_tensors(cache))


def slots_for(positions: torch.Tensor, block_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slot of each position: ``block_table[b, pos // block_size] * block_size + pos % block_size``."""
    blocks = torch.gather(block_table.long(), 1, torch.div(positions, block_size, rounding_mode="floor"))
    return blocks * block_size + positions % block_size


def num_blocks_for(tokens: int, block_size: int) -> int:
    return (tokens + block_size - 1) // block_size


def _write(cache: torch.Tensor, block: torch.Tensor, offset: torch.Tensor, valid: torch.Tensor,
           values: torch.Tensor) -> None:
    # Rows that write nothing carry slot 0's current value into slot 0 (the reserved null block): static shapes,
    # slot 0 unchanged. ``index_put_`` on the 3-D cache (not ``index_copy_`` on a flattened view, which inductor
    # turns into a copy of the whole cache per write) keeps the compiled write in place.
    cache.index_put_((block, offset), torch.where(valid, values.to(cache.dtype), cache[0, 0].expand_as(values)))


def _write_npu(cache: torch.Tensor, slot: torch.Tensor, valid: torch.Tensor, values: torch.Tensor) -> None:
    """torch_npu's scatter update, as vllm-ascend's torchair MLA wrote its caches: torchair has no GE converter
    for ``index_put`` (its converter only raises), one for ``npu_scatter_nd_update``. The out-of-place op in a
    graph (functionalisation gives the same pair for the in-place one: the op, then a copy into the input)."""
    import torch_npu  # needs CANN; imported on the NPU path only

    flat = cache.view(-1, cache.shape[-1])
    rows = torch.where(valid, values.to(cache.dtype), flat[0].expand_as(values))
    index = slot.unsqueeze(-1)
    if torch.compiler.is_compiling():
        cache.copy_(torch_npu.npu_scatter_nd_update(flat, index, rows).view_as(cache))
    else:
        torch_npu.npu_scatter_nd_update_(flat, index, rows)


def write_latent_cache(cache: LatentCache, slot_mapping: torch.Tensor, c_kv: torch.Tensor,
                       k_pe: torch.Tensor, npu: bool = False) -> None:
    """Write ``c_kv [N, C]`` and ``k_pe [N, R]`` at ``slot_mapping [N]`` (slot -1 writes nothing); ``npu``:
    through torch_npu's scatter op (the NPU graphs' write)."""
    block_size = block_size_of(cache)
    valid = (slot_mapping >= 0).unsqueeze(-1)
    slot = torch.where(slot_mapping >= 0, slot_mapping, torch.zeros_like(slot_mapping))
    parts = ((cache, torch.cat([c_kv, k_pe], dim=-1)),) if isinstance(cache, torch.Tensor) else (
        (cache[0], c_kv), (cache[1], k_pe))
    for target, values in parts:
        if npu:
            _write_npu(target, slot, valid, values)
        else:
            _write(target, torch.div(slot, block_size, rounding_mode="floor"), slot % block_size, valid, values)
