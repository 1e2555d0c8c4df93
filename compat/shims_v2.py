"""The V2 model runner's API as the adapter meets it (``vllm/v1/worker/gpu/``): the seam, the speculator's methods,
and the state it reads, each probed on the live object (see ``shims.py`` for the rules).
"""
from __future__ import annotations

import importlib
from typing import Any

import torch

from .manifest import covers
from .shims import Missing, missing_methods

#: the module whose global ``init_speculator`` V2's runner calls by name, and the speculator class we subclass
V2_RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"
V2_SEAM = "init_speculator"
V2_MTP_MODULE = "vllm.v1.worker.gpu.spec_decode.mtp.speculator"
V2_MTP_CLASS = "MTPSpeculator"

#: the speculator methods V2's runner calls and the parameters the adapter handles (manifest items MTPSpeculator.*)
SPECULATOR_METHODS: dict[str, tuple[str, ...]] = {
    "__init__": ("vllm_config", "device"),
    "load_model": ("target_model",),
    "set_attn": ("model_state", "kv_cache_config", "block_tables"),
    "init_cudagraph_manager": ("cudagraph_mode",),
    "capture": (),
    "propose": ("input_batch", "attn_metadata", "slot_mappings", "last_hidden_states", "aux_hidden_states",
                "num_sampled", "num_rejected", "last_sampled", "next_prefill_tokens", "temperature", "seeds",
                "dummy_run", "is_profile", "num_speculative_tokens"),
}


@covers("v2_speculator_seam")
def mtp_speculator_class() -> type | None:
    """V2's ``MTPSpeculator``, or None where the release has no V2 runner (or moved it)."""
    try:
        return getattr(importlib.import_module(V2_MTP_MODULE), V2_MTP_CLASS)
    except (ImportError, AttributeError):
        return None


@covers("v2_speculator_seam")
def probe_speculator_api(speculator_cls: type | None) -> list[Missing]:
    """Check V2's speculator class before the adapter relies on it."""
    if speculator_cls is None:
        return [Missing(f"{V2_MTP_MODULE}.{V2_MTP_CLASS}", "cannot be imported", "MTPSpeculator")]
    return missing_methods(speculator_cls, SPECULATOR_METHODS, V2_MTP_CLASS, "MTPSpeculator")


@covers("v2_speculator_seam")
def cudagraph_mode_none() -> Any:
    """``CUDAGraphMode.NONE``: V2 captures none of its speculator where our graphs replace it."""
    from vllm.config.compilation import CUDAGraphMode

    return CUDAGraphMode.NONE


@covers("v2_kv_groups")
def v2_kv_group(kv_cache_config: Any, layer_name: str) -> tuple[int, int]:
    """``(group id, block size)`` of the KV cache group holding the draft layer: its row of V2's block tables."""
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        if layer_name in group.layer_names:
            return gid, int(group.kv_cache_spec.block_size)
    raise KeyError(f"draft attention layer {layer_name!r} is in no KV cache group of {kv_cache_config!r}")


@covers("v2_kv_groups")
def v2_draft_slots(slot_mappings: dict[str, torch.Tensor] | None, layer_name: str, block_tables: Any,
                   group: int) -> torch.Tensor:
    """The verify batch's slot per token for the draft layer: the runner's per-layer mapping, else its group's."""
    if slot_mappings and layer_name in slot_mappings:
        return slot_mappings[layer_name]
    return block_tables.slot_mappings[group]


@covers("v2_prefill_tokens")
def v2_prefill_next_tokens(next_prefill_tokens: torch.Tensor) -> torch.Tensor:
    """``[max_num_reqs]``: a chunked prefill's next prompt token per request slot. Releases with prefill lookahead
    keep ``[num_prefill_lookahead, max_num_reqs]``, of which the first row is the next token."""
    return next_prefill_tokens[0] if next_prefill_tokens.dim() == 2 else next_prefill_tokens


@covers("v2_prefill_tokens")
def v2_last_sampled_tokens(last_sampled: torch.Tensor) -> torch.Tensor:
    """``[max_num_reqs]``: the last token sampled per request slot (kept ``[max_num_reqs, 1]`` in 0.32)."""
    return last_sampled[:, 0] if last_sampled.dim() == 2 else last_sampled


@covers("v2_runner_choice")
def runner_drafter(model_runner: Any) -> tuple[str, Any]:
    """``(runner kind, the drafter it built)``: V1 keeps ``drafter``, V2 ``speculator``; ``("", None)`` for neither."""
    if hasattr(model_runner, "speculator"):
        return "v2", model_runner.speculator
    if hasattr(model_runner, "drafter"):
        return "v1", model_runner.drafter
    return "", None
