"""The draft layer's KV cache that vLLM allocated, viewed in the layout our graphs read and write.
The views share storage: what our draft graph writes is what vLLM's own MTP layer would have written.
"""
from __future__ import annotations

from typing import Any

from ascend_spec.graph.config import ModelConfig
from ascend_spec.graph.family import LayerCache

from .sfa_cache import dsa_cache_parts
from .shims import bound_kv_cache, draft_block_size, draft_kv_cache_parts, raise_if_missing

__all__ = ["draft_block_size", "draft_cache_view", "draft_layer_names"]


def draft_layer_names(proposer: Any) -> list[str]:
    """Names of the draft attention layers, from the attention groups vLLM built for the drafter."""
    names: list[str] = []
    for group in proposer.draft_attn_groups:
        names.extend(group.layer_names)
    return sorted(names)


def draft_cache_view(vllm_config: Any, layer_name: str, cfg: ModelConfig, block_size: int) -> LayerCache:
    """The cache bound to ``layer_name`` in the layout ``cfg``'s family reads (views, no copy): the latent single
    ``[num_blocks, block_size, C + R]`` or pair ``([.., C], [.., R])``; a sparse-attention family's the pair and
    its indexer's keys (vllm-ascend's SFA cache, :mod:`.sfa_cache`)."""
    context = vllm_config.compilation_config.static_forward_context
    widths = (cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    sparse = cfg.sparse_attention()
    if sparse is not None:
        cache, missing = dsa_cache_parts(context, layer_name, widths, sparse["index_head_dim"], block_size)
        raise_if_missing(missing, "draft KV cache layout (sparse attention)")
        return cache
    cache, missing = draft_kv_cache_parts(bound_kv_cache(context.get(layer_name)), layer_name, widths, block_size)
    raise_if_missing(missing, "draft KV cache layout")
    return cache
