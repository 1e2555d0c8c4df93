"""The draft layer's KV cache that vLLM allocated, viewed in the layout our graphs read and write.

vLLM registers one MLA attention layer per MTP layer (``model.layers.{N}.self_attn.attn``), sizes and
allocates its cache with the target's layers (one KV cache group, one block table) and binds it to the
layer as ``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` (0.32; ``[num_blocks, 1, block,
latent]`` in the runner's list). Per token: ``[:kv_lora_rank]`` the normed latent, then ``k_pe`` after
interleaved RoPE, which is ``graph.attention``'s layout. The view shares storage: what our draft graph
writes is what vLLM's own MTP layer would have written, at the same slots.
"""
from __future__ import annotations

from typing import Any

import torch

from .shims import bound_kv_cache, draft_block_size, probe_draft_kv_cache, raise_if_missing

__all__ = ["draft_block_size", "draft_cache_view", "draft_layer_names"]


def draft_layer_names(proposer: Any) -> list[str]:
    """Names of the draft attention layers, from the attention groups vLLM built for the drafter."""
    names: list[str] = []
    for group in proposer.draft_attn_groups:
        names.extend(group.layer_names)
    return sorted(names)


def draft_cache_view(vllm_config: Any, layer_name: str, latent: int, block_size: int) -> torch.Tensor:
    """``[num_blocks, block_size, latent]`` view of the cache bound to ``layer_name`` (no copy)."""
    layer = vllm_config.compilation_config.static_forward_context.get(layer_name)
    kv = bound_kv_cache(layer)
    raise_if_missing(probe_draft_kv_cache(kv, layer_name, latent, block_size), "draft KV cache layout")
    return kv.squeeze(1) if kv.dim() == 4 else kv
