"""vllm-ascend's SFA cache of a DSA draft layer as our family's layer cache ``(nope, rope, index_keys)``: views, no
copy. Its two bindings (the whole tuple on the MLA layer; the keys on the indexer's own layer) are in compat/README.md.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from .manifest import covers
from .shims import Missing, bound_kv_cache, draft_kv_cache_parts, squeeze_head_axis

#: where vLLM's ``Indexer`` registers its key cache, after the attention module's prefix
INDEXER_CACHE_SUFFIX = ".indexer.k_cache"
#: a bound cache with this many tensors holds the indexer's keys after the latent pair (v0.23.0's protocol)
_TUPLE_WITH_KEYS = 3
_WHERE = "CompilationConfig.static_forward_context"


def indexer_cache_layer(attn_layer: str) -> str:
    """``model.layers.N.self_attn.attn`` → ``model.layers.N.self_attn.indexer.k_cache``."""
    return attn_layer.rsplit(".", 1)[0] + INDEXER_CACHE_SUFFIX


def latent_layers(names: Sequence[str]) -> list[str]:
    """The draft's attention layers without the indexers' key-cache layers vLLM registers beside them."""
    return [n for n in names if not n.endswith(INDEXER_CACHE_SUFFIX)]


@covers("ascend_sfa_cache")
def dsa_cache_parts(context: dict[str, Any], layer_name: str, widths: tuple[int, int], index_width: int,
                    block_size: int) -> tuple[tuple[torch.Tensor, ...] | None, list[Missing]]:
    """The draft layer's SFA cache as ``(nope [N, block, C], rope [N, block, R], keys [N, block, index_width])``,
    or None and what is wrong. ``context``: vLLM's ``static_forward_context``."""
    bound = bound_kv_cache(context.get(layer_name))
    where = f"static_forward_context[{layer_name!r}].kv_cache"
    if isinstance(bound, tuple) and len(bound) > _TUPLE_WITH_KEYS:
        return None, [_int8_keys(where, bound[_TUPLE_WITH_KEYS])]
    if isinstance(bound, tuple) and len(bound) == _TUPLE_WITH_KEYS:
        latent_part, keys = bound[:2], bound[2]
    else:
        latent_part = bound
        keys_layer = indexer_cache_layer(layer_name)
        where = f"static_forward_context[{keys_layer!r}].kv_cache"
        keys = bound_kv_cache(context.get(keys_layer))
        if isinstance(keys, tuple):
            return None, [_int8_keys(where, keys[-1])]
        if keys is None:
            return None, [Missing(where, "no indexer key cache bound beside the draft layer's latent cache (neither "
                                         "in its own tuple nor on the indexer's cache layer)", _WHERE)]
    latent, missing = draft_kv_cache_parts(latent_part, layer_name, widths, block_size)
    if latent is None:
        return None, missing
    if isinstance(latent, torch.Tensor):
        return None, [Missing(f"static_forward_context[{layer_name!r}].kv_cache", f"one latent tensor "
                              f"{tuple(latent.shape)} ({latent.dtype}): vllm-ascend's SFA binds nope and rope apart; "
                              "a packed int8 latent (sparse C8) is not read by ours", _WHERE)]
    flat = squeeze_head_axis(keys, block_size)
    nope = latent[0]
    if flat is None or flat.shape[1:] != (block_size, index_width) or flat.shape[0] != nope.shape[0] \
            or flat.dtype != nope.dtype:
        return None, [Missing(where, f"indexer keys {tuple(keys.shape)} {keys.dtype}; ours reads "
                                     f"[{nope.shape[0]}, {block_size}, 1, {index_width}] {nope.dtype} (the latent's "
                                     "blocks and dtype)", _WHERE)]
    return (latent[0], latent[1], flat), []


def _int8_keys(where: str, scale: torch.Tensor) -> Missing:
    return Missing(where, f"indexer keys with a scale cache {tuple(scale.shape)} ({scale.dtype}): int8 indexer "
                          "keys (sparse LI C8) are not read by ours; allowed: unquantised indexer keys", _WHERE)
