# excerpt of vllm-ascend v0.25.1rc1: vllm_ascend/ascend_forward_context.py (signatures)
import importlib.util
import math
from contextlib import contextmanager
from contextvars import ContextVar
from enum import Enum
from typing import Any
import torch
import vllm.envs as envs_vllm
from vllm.config import CUDAGraphMode, VllmConfig
from vllm.distributed import get_dp_group, get_ep_group, get_tensor_model_parallel_world_size
from vllm.forward_context import BatchDescriptor, get_forward_context, set_forward_context
from vllm.logger import logger
from vllm_ascend.ascend_config import get_ascend_config
from vllm_ascend.utils import AscendDeviceType, enable_sp, get_ascend_device_type, has_layer_idx, is_drafter_moe_model, is_moe_model

class MoECommType(Enum):
    ALLGATHER = 0
    MC2 = 1
    ALLTOALL = 2
    FUSED_MC2 = 3

@contextmanager
def override_mrv2_in_profile_run(enabled: bool):
    ...

def get_mrv2_in_profile_run() -> bool:
    ...

def _cann_megamoe_supported_by_config(vllm_config: VllmConfig) -> bool:
    ...

@contextmanager
def set_ascend_forward_context(attn_metadata: Any, vllm_config: VllmConfig, num_tokens: int=0, num_tokens_across_dp: torch.Tensor | None=None, in_profile_run: bool=False, num_actual_tokens: int | None=None, aclgraph_runtime_mode: CUDAGraphMode=CUDAGraphMode.NONE, batch_descriptor: BatchDescriptor | None=None, model_instance: torch.nn.Module=None, is_draft_model=False, skip_compiled: bool=False, max_tokens_across_pcp: int=0, draft_attn_metadatas=None, has_sinks=False, input_ids=None, eplb_heat_collection_status: bool=False):
    ...

def set_mc2_tokens_capacity(vllm_config, max_num_reqs, uniform_decode_query_len):
    ...

def get_mc2_tokens_capacity():
    ...

def set_mc2_mask(vllm_config, device):
    ...

def get_mc2_mask():
    ...

def _select_a2_moe_comm_method(num_tokens: int, vllm_config: VllmConfig, mc2_tokens_capacity: int) -> MoECommType:
    ...

def _select_a3_moe_comm_method(num_tokens: int, mc2_tokens_capacity: int, vllm_config: VllmConfig) -> MoECommType:
    ...

def _select_a5_moe_comm_method(num_tokens: int, vllm_config: VllmConfig, mc2_tokens_capacity: int) -> MoECommType:
    ...

def select_moe_comm_method(num_tokens: int, vllm_config: VllmConfig) -> MoECommType | None:
    ...

class _ExtraForwardContextProxy:
    extra_attrs = ('capturing', 'moe_comm_type', 'moe_comm_method', 'mmrs_fusion', 'num_tokens', 'flash_comm_v1_enabled', 'pad_size', 'padded_length', 'num_tokens_across_dp', 'mc2_mask', 'is_draft_model', 'is_draft_model_prefill', 'prefetch_mlp_gate_up_proj', 'prefetch_mlp_down_proj', 'model_instance', 'layer_idx', 'max_tokens_across_dp', 'max_tokens_across_pcp', 'num_accept_tokens', 'in_profile_run', 'padded_num_tokens', 'sinks', 'eplb_heat_collection_status')

    def check_extra_attr(self, name: str):
        ...

    @staticmethod
    def _ctx():
        ...

    def __getattr__(self, name: str) -> Any:
        ...

    def __setattr__(self, name: str, value: Any) -> None:
        ...
