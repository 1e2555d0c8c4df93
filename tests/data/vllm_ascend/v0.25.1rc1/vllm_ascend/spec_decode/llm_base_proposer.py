# excerpt of vllm-ascend v0.25.1rc1: vllm_ascend/spec_decode/llm_base_proposer.py (signatures)
import copy
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Any, cast
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from vllm.config import CUDAGraphMode, VllmConfig, get_layers_from_vllm_config
from vllm.distributed.parallel_state import get_pp_group, get_tp_group, get_world_group, init_model_parallel_group
from vllm.forward_context import BatchDescriptor, ForwardContext, get_forward_context
from vllm.logger import logger
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.models import supports_multimodal
from vllm.model_executor.models.deepseek_eagle3 import Eagle3DeepseekV2ForCausalLM
from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache
from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM
from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM
from vllm.triton_utils import HAS_TRITON, triton
from vllm.utils.platform_utils import is_pin_memory_available
from vllm.v1.attention.backends.utils import CommonAttentionMetadata
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
from vllm.v1.spec_decode.utils import PADDING_SLOT_ID, compute_new_slot_mapping, extend_all_queries_by_N
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch
from vllm_ascend.ascend_config import get_ascend_config
from vllm_ascend.ascend_forward_context import _EXTRA_CTX, set_ascend_forward_context
from vllm_ascend.attention.attention_mask import AttentionMaskBuilder
from vllm_ascend.attention.attention_v1 import AscendAttentionState
from vllm_ascend.attention.utils import AscendCommonAttentionMetadata
from vllm_ascend.compilation.acl_graph import ACLGraphWrapper, update_full_graph_params
from vllm_ascend.device.device_op import DeviceOperator
from vllm_ascend.distributed.parallel_state import get_lmhead_tp_group
from vllm_ascend.models.deepseek_v4_dspark import DSparkDeepseekV4ForCausalLM
from vllm_ascend.models.llama_eagle3_vwn import Eagle3VwnLlamaForCausalLM
from vllm_ascend.ops.triton.spec_decode.utils import prepare_inputs_padded_kernel
from vllm_ascend.ops.triton.triton_utils import get_vectorcore_num
from vllm_ascend.spec_decode.utils import SlidingWindowAdapter, _disable_flash_comm_v1_context, _maybe_eager_context, patch_tensor_parallel_group
from vllm_ascend.utils import check_gdn_layer, enable_sp, lmhead_tp_enable, shared_expert_dp_enabled

def split_inputs_tp_to_sp(hidden_states, out):
    ...

def greedy_sample(logits: torch.Tensor) -> torch.Tensor:
    ...

def _is_glm_model(model_config) -> bool:
    """Return True if the target model belongs to the GLM series.

    Detection is based on the model_type string (covers glm, chatglm, glm4,
    glm4_moe, glm4_moe_lite, glm4_1v, glm_ocr, glm_moe_dsa, etc).
    """
    hf_text_config = getattr(model_config, 'hf_text_config', None)
    model_type = getattr(hf_text_config, 'model_type', '') or ''
    return 'glm' in str(model_type).lower()

class AscendSpecDecodeBaseProposer(SpecDecodeBaseProposer):
    _runnable: ACLGraphWrapper | Callable

    def __init__(self, vllm_config: VllmConfig, device: torch.device, pass_hidden_states_to_model: bool, runner=None):
        ...

    def _raise_if_padded_drafter_batch_disabled_and_full_graph_enabled(self):
        ...

    def _get_model(self) -> nn.Module:
        ...

    def load_model(self, model: nn.Module) -> None:
        ...

    def _maybe_share_embeddings(self, target_language_model: nn.Module) -> None:
        ...

    def _maybe_share_lm_head(self, model: nn.Module) -> None:
        ...

    def _maybe_share_topk_indices(self, target_language_model: nn.Module) -> None:
        if hasattr(target_language_model.model, 'topk_indices_buffer'):
            if hasattr(self.model.model, 'topk_indices_buffer'):
                del self.model.model.topk_indices_buffer
            self.model.model.topk_indices_buffer = target_language_model.model.topk_indices_buffer
            logger.info('[spec_decode/base] Detected MTP model with topk_indices_buffer. Sharing target model topk_indices_buffer with the draft model.')
            target_buffer = target_language_model.model.topk_indices_buffer
            draft_model = getattr(self.model, 'model', None)
            if target_buffer is not None and draft_model is not None:
                for _, module in draft_model.named_modules():
                    if hasattr(module, 'topk_indices_buffer'):
                        module.topk_indices_buffer = target_buffer

    def get_model(self) -> nn.Module:
        ...

    def shallow_copy_metadata(self, attn_metadata):
        ...

    @torch.inference_mode()
    def dummy_run(self, num_tokens: int, with_prefill: bool=False, in_graph_capturing: bool=False, num_reqs: int=0, num_tokens_across_dp: torch.Tensor | None=None, aclgraph_runtime_mode: CUDAGraphMode=CUDAGraphMode.NONE, batch_descriptor=None, dummy_compute_logits=lambda hidden_states: None, is_profile=False):
        ...

    def _update_full_graph_params_if_needed(self, forward_context: ForwardContext, num_input_tokens: int, multi_steps_attn_metadata: list[dict[str, Any]]) -> None:
        ...

    def _propose(self, target_token_ids: torch.Tensor, target_positions: torch.Tensor, target_hidden_states: torch.Tensor, next_token_ids: torch.Tensor, token_indices_to_sample: torch.Tensor | None, common_attn_metadata: CommonAttentionMetadata, target_model_batch_desc: BatchDescriptor, sampling_metadata: SamplingMetadata, mm_embed_inputs: tuple[list[torch.Tensor], torch.Tensor] | None=None, req_scheduled_tokens=None, long_seq_metadata=None, num_prefill_reqs=0, num_decode_reqs=0, scheduler_output: SchedulerOutput=None, num_scheduled_tokens: int=0, num_rejected_tokens_gpu: torch.Tensor | None=None) -> torch.Tensor:
        ...

    def compute_draft_token_ids(self, hidden_states: torch.Tensor):
        ...

    def _run_merged_draft(self, num_input_tokens, batch_size, token_indices_to_sample, target_positions, inputs_embeds, multi_steps_attn_metadata, num_tokens, is_prefill=None) -> torch.Tensor:
        ...

    def set_inputs_first_pass(self, target_token_ids: torch.Tensor, next_token_ids: torch.Tensor, target_positions: torch.Tensor, target_hidden_states: torch.Tensor, token_indices_to_sample: torch.Tensor | None, cad: CommonAttentionMetadata, num_rejected_tokens_gpu: torch.Tensor | None, req_scheduled_tokens=None, long_seq_metadata=None, num_prefill_reqs=0, num_decode_reqs=0) -> tuple[int, torch.Tensor, CommonAttentionMetadata, tuple[Any, Any] | None]:
        ...

    def model_returns_tuple(self) -> bool:
        ...

    def attn_update_stack_num_spec_norm(self, draft_index, old_common_metadata, batch_size, input_batch_size, used_update_positions, aclgraph_runtime_mode, ori_seq_len=None, ori_seq_len_cpu=None, slot_indices=None, mtp_slot_mapping=None, attn_group=None):
        ...

    def prepare_next_token_ids_padded(self, sampled_token_ids: torch.Tensor, requests: dict[str, CachedRequestState], gpu_input_batch: InputBatch, discard_request_indices: torch.Tensor, num_discarded_requests: int) -> tuple[torch.Tensor, torch.Tensor]:
        ...

    def prepare_inputs(self, common_attn_metadata: CommonAttentionMetadata, sampled_token_ids: list[list[int]], num_draft_tokens: list[int]) -> tuple[CommonAttentionMetadata, torch.Tensor]:
        ...

    def prepare_inputs_padded(self, common_attn_metadata: CommonAttentionMetadata, spec_decode_metadata: SpecDecodeMetadata, valid_sampled_tokens_count: torch.Tensor) -> tuple[CommonAttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor]:
        ...

    def _update_full_graph_params(self, forward_context, num_tokens, draft_attn_metadatas=None):
        ...

    def _adjust_tensor(self, tensor, desired_size):
        ...

    def maybe_pad_and_reduce(self, hidden_states: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ...

    def maybe_all_gather_and_unpad(self, last_hidden_states: torch.Tensor, positions: torch.Tensor, hidden_states: torch.Tensor | None=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        ...

    def _align_tensor_and_indices(self, tensor, num_indices, token_indices_to_sample, ori_token_indices_to_sample, is_logits=False):
        ...

    def build_draft_attn_metadata(self, common_attn_metadata, num_input_tokens, num_actual_tokens):
        ...

    def _pad_draft_buffers(self, num_actual_tokens: int, num_input_tokens: int) -> None:
        ...
