"""vllm-ascend's forward context around our drafts and warm-up, and its MoE context: what both of vllm-ascend's
runners' adapters (``ascend.py`` for V1, ``ascend_v2.py`` for V2) enter.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

from .manifest import covers
from .shims import call_with_supported
from .shims_parallel import moe_forward_context

FORWARD_CONTEXT_MODULE = "vllm_ascend.ascend_forward_context"
FORWARD_CONTEXT = "set_ascend_forward_context"


class AscendNpuContextMixin:
    """vllm-ascend's forward context around our draft and warm-up, and its MoE context (both runners)."""

    vllm_config: Any

    def _tokens_across_dp(self) -> Any:
        """Every rank's token count the runner agreed for this step, where it hands one over (V2), else None."""
        return None

    def _draft_context(self, rows: int, width: int) -> Any:
        # sized as the draft runs: graph rows × query width (at least 1 + K, a prefill chunk padded to a graph's width)
        return forward_context(self._ascend_context_fn(), self.vllm_config,
                               self._ascend.graph.tokens_for(rows, width), self._tokens_across_dp())

    def _warmup_context(self, num_tokens: int) -> Any:
        return forward_context(self._ascend_context_fn(), self.vllm_config, num_tokens, self._tokens_across_dp())

    def _moe_context(self) -> Any:
        # On the NPU the torchair graph traces vllm-ascend's MoE inside the draft / warm-up context; an opaque MoE
        # (the drafter on another device) enters vllm-ascend's context itself where none is set.
        set_ctx = self._ascend_context_fn()
        return moe_forward_context(self.vllm_config, lambda n: forward_context(set_ctx, self.vllm_config, n))

    @staticmethod
    def _ascend_context_fn() -> Callable[..., Any]:
        return getattr(importlib.import_module(FORWARD_CONTEXT_MODULE), FORWARD_CONTEXT)


@covers("ascend_forward_context_params")
def forward_context(set_ctx: Callable[..., Any], vllm_config: Any, num_tokens: int,
                    num_tokens_across_dp: Any = None) -> Any:
    """vllm-ascend's forward context for a draft of ``num_tokens`` (MoE communication, TP groups read it). Only
    keywords every supported release accepts are passed; releases add and drop others (``input_ids``). The
    runner's ``num_tokens_across_dp`` (V2) is passed on where given: the context then agrees no counts itself."""
    extra = {} if num_tokens_across_dp is None else {"num_tokens_across_dp": num_tokens_across_dp}
    return call_with_supported(set_ctx, None, vllm_config, num_tokens=num_tokens, is_draft_model=True,
                               in_profile_run=False, **extra)
