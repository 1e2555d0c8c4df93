"""The draft layer's KV cache that vLLM allocated, viewed in the layout our graphs read and write.
The views share storage: what our draft graph writes is what vLLM's own MTP layer would have written.
"""
from __future__ import annotations

from typing import Any

from ascend_spec.graph.latent_cache import LatentCache

from .shims import bound_kv_cache, draft_block_size, draft_kv_cache_parts, raise_if_missing

__all__ = ["draft_block_size", "draft_cache_view", "draft_layer_names"]


def draft_layer_names(proposer: Any) -> list[str]:
    """Names of the draft attention layers, from the attention groups vLLM built for the drafter."""
    names: list[str] = []
    for group in proposer.draft_attn_groups:
        names.extend(group.layer_names)
    return sorted(names)


def draft_cache_view(vllm_config: Any, layer_name: str, widths: tuple[int, int], block_size: int) -> LatentCache:
    """The cache bound to ``layer_name`` in our layout (views, no copy): single ``[num_blocks, block_size, C + R]``
    or the pair ``([num_blocks, block_size, C], [num_blocks, block_size, R])``; ``widths`` = ``(C, R)``."""
    layer = vllm_config.compilation_config.static_forward_context.get(layer_name)
    cache, missing = draft_kv_cache_parts(bound_kv_cache(layer), layer_name, widths, block_size)
    raise_if_missing(missing, "draft KV cache layout")
    return cache
