# excerpt of vllm-ascend v0.23.0: vllm_ascend/attention/sfa_v1.py (signatures)
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar
import scipy
import torch
import torch_npu
import vllm.envs as envs_vllm
from torch import nn
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_world_size, get_tp_group
from vllm.logger import logger
from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadataBuilder
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.triton_utils import HAS_TRITON
from vllm.v1.attention.backend import AttentionBackend, AttentionCGSupport, MLAAttentionImpl
from vllm.v1.kv_cache_interface import AttentionSpec
from vllm.v1.worker.utils import select_common_block_size
from vllm_ascend.ascend_config import get_ascend_config
from vllm_ascend.ascend_forward_context import _EXTRA_CTX
from vllm_ascend.attention.attention_mask import AttentionMaskBuilder
from vllm_ascend.attention.attention_v1 import AscendAttentionState
from vllm_ascend.attention.context_parallel.common_cp import AscendPCPMetadata
from vllm_ascend.attention.mla_v1 import MAX_O_PROJ_PREFETCH_SIZE, MLAPO_MAX_SUPPORTED_TOKENS
from vllm_ascend.attention.utils import SFA_QSFA_TILE_SIZE, AscendCommonAttentionMetadata, ascend_chunked_prefill_workspace_size, enable_cp, get_sfa_qsfa_packed_head_dim, maybe_save_kv_layer_to_connector, notify_kv_cache_written, trans_rope_weight, transdata, wait_for_kv_layer_from_connector
from vllm_ascend.device.device_op import DeviceOperator
from vllm_ascend.device.mxfp_compat import FLOAT8_E8M0FNU_DTYPE
from vllm_ascend.distributed.utils import all_gather_async
from vllm_ascend.memcache_comm_fence import record_attention_compute_start
from vllm_ascend.ops.layer_shard_linear import is_hidden_layer, post_process_after_loading_for_shard_weight_series, reach_layer_for_shard_weight_series, register_all_layers_to_shard_weight_series
from vllm_ascend.ops.rotary_embedding import get_cos_and_sin_mla
from vllm_ascend.ops.triton.rope import rope_forward_triton_siso
from vllm_ascend.quantization.methods import AscendW8A8DynamicLinearMethod, AscendW8A8LinearMethod, AscendW8A8MXFP8DynamicLinearMethod
from vllm_ascend.utils import ACL_FORMAT_FRACTAL_ND, ACL_FORMAT_FRACTAL_NZ, AscendDeviceType, _round_up, dispose_layer, enable_dsa_cp, enable_dsa_cp_with_layer_shard, enable_dsa_cp_with_o_proj_tp, enable_sfa_dcp_replicated_indexer, enable_sp, get_ascend_device_type, get_weight_prefetch_method, maybe_trans_nz
from vllm_ascend.worker.npu_input_batch import NPUInputBatch

class _ByteGatherPart(NamedTuple):
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    num_bytes_per_row: int

class DCPGatherContext(NamedTuple):
    gathered: torch.Tensor
    handle: torch.distributed.Work | None
    restore_perm: tuple[int, ...] | None
    split_sizes: tuple[int, ...]

def _get_indexer_types(configs: tuple[Any, ...]) -> Any | None:
    ...

def _has_shared_indexer_layers(configs: tuple[Any, ...]) -> bool:
    ...

def _get_config_bool(configs: tuple[Any, ...], attr: str) -> bool:
    ...

class AscendSFABackend(AttentionBackend):
    accept_output_buffer: bool = True

    @staticmethod
    def get_name() -> str:
        ...

    @staticmethod
    def get_builder_cls():
        ...

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_type: str='') -> tuple[int, ...]:
        return (num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_impl_cls() -> type['AscendSFAImpl']:
        ...

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int]:
        return [128]

@dataclass
class DCPContext:
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    kv_gather_block_ids: torch.Tensor | None = None
    kv_gather_block_table: torch.Tensor | None = None
    gather_context: DCPGatherContext | None = None

@dataclass
class DSACPContext:
    num_tokens: int
    num_tokens_pad: int
    local_start: int
    local_end: int
    local_end_with_pad: int
    slot_mapping_cp: torch.Tensor
    actual_seq_lengths_query: torch.Tensor
    actual_seq_lengths_key: torch.Tensor

@dataclass
class AscendSFAMetadata:
    num_actual_tokens: int
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    cum_query_lens: torch.Tensor
    block_table: torch.Tensor
    sin: torch.Tensor
    cos: torch.Tensor
    num_input_tokens: int = 0
    head_dim: int | None = None
    attn_mask: torch.Tensor = None
    attn_state: AscendAttentionState = AscendAttentionState.ChunkedPrefill
    dcp_context: DCPContext | None = None
    dsa_cp_context: DSACPContext | None = None
    reshape_cache_event: torch.npu.Event = None
    sfa_cp_metadata: AscendPCPMetadata | None = None
    num_decodes: int = 0
    num_decode_tokens: int = 0
    num_prefills: int = 0
    block_size: int = 0
    group_len: torch.Tensor | None = None
    group_key_idx: torch.Tensor | None = None
    group_key_cache_idx: torch.Tensor | None = None

class AscendSFAMetadataBuilder(MLACommonMetadataBuilder[AscendSFAMetadata]):

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config: VllmConfig, device: torch.device, metadata_cls: type[AscendSFAMetadata] | None=None, supports_dcp_with_varlen: bool=False):
        ...

    @staticmethod
    def determine_chunked_prefill_workspace_size(vllm_config: VllmConfig) -> int:
        ...

    @classmethod
    def get_cudagraph_support(cls: type['AscendSFAMetadataBuilder'], vllm_config: VllmConfig, kv_cache_spec: AttentionSpec) -> AttentionCGSupport:
        ...

    def reorder_batch(self, input_batch: 'NPUInputBatch', scheduler_output: 'SchedulerOutput') -> bool:
        ...

    def build(self, common_prefix_len: int, common_attn_metadata: AscendCommonAttentionMetadata, fast_build: bool=False, **kwargs) -> AscendSFAMetadata:
        ...

    def build_for_drafting(self, common_attn_metadata: AscendCommonAttentionMetadata, draft_index: int, **kwargs) -> AscendSFAMetadata:
        ...

    def _build(self, common_attn_metadata: AscendCommonAttentionMetadata, draft_index: int | None=None) -> AscendSFAMetadata:
        ...

    def build_for_graph_capture(self, common_attn_metadata: AscendCommonAttentionMetadata, attn_state: AscendAttentionState=AscendAttentionState.DecodeOnly):
        ...

class AscendSFAImpl(MLAAttentionImpl):
    o_proj_full_pools: dict[tuple[str, int | None, torch.dtype, int, tuple[int, ...]], torch.Tensor] = {}
    q_hadamard: torch.Tensor | None = None
    k_hadamard: torch.Tensor | None = None

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, alibi_slopes: list[float] | None, sliding_window: int | None, kv_cache_dtype: str, logits_soft_cap: float | None, attn_type: str, kv_sharing_target_layer_name: str | None, **kwargs) -> None:
        ...

    @staticmethod
    def update_graph_params(update_stream, forward_context, num_tokens, vllm_config=None, speculative_config=None, num_dcp_pcp_tokens=None, draft_attn_metadatas=None):
        ...

    def process_weights_after_loading(self, act_dtype: torch.dtype):
        ...

    @staticmethod
    def _is_w8a8_dynamic_linear(layer: torch.nn.Module | None) -> bool:
        ...

    def _get_sfa_prolog_v3_unsupported_reasons(self) -> list[str]:
        ...

    def _process_weights_for_fused_prolog_v3(self) -> None:
        ...

    def _process_weights_for_fused_mlapo(self, act_dtype: torch.dtype):
        ...

    def _process_weights_for_fused_mlapo_a5(self, act_dtype: torch.dtype):
        ...

    def _process_weights_for_fused_mlapo_a5_float(self, act_dtype: torch.dtype):
        ...

    def forward_mha(self, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: M, k_scale: torch.Tensor, output: torch.Tensor) -> None:
        ...

    def forward_mqa(self, q: torch.Tensor | tuple[torch.Tensor, torch.Tensor], kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: M, layer) -> tuple[torch.Tensor, torch.Tensor | None]:
        ...

    def rope_single(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ...

    def _init_o_proj_tp_full_params(self):
        ...

    def _iter_o_proj_input_sharded_quant_params(self):
        ...

    def _switch_o_proj_params(self, params: dict[str, torch.Tensor]):
        ...

    def _get_o_proj_linear_method(self):
        ...

    def _is_o_proj_unquantized(self) -> bool:
        ...

    def _apply_o_proj_full_weight(self, attn_output: torch.Tensor) -> torch.Tensor:
        ...

    def _handle_o_proj_weight_switch_and_forward(self, attn_output: torch.Tensor, output: torch.Tensor, o_proj_full_handle: torch.distributed.Work | None, o_proj_full_param_handles: list[torch.distributed.Work | None] | None, should_shard_weight: bool) -> tuple[torch.Tensor, bool]:
        ...

    @staticmethod
    def _flatten_for_byte_gather(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
        ...

    @classmethod
    def _all_gather_byte_packed_async(cls, parts: list[tuple[str, torch.Tensor]], async_op: bool) -> tuple[torch.Tensor, torch.distributed.Work | None, tuple[_ByteGatherPart, ...]]:
        ...

    @staticmethod
    def _restore_byte_gathered_tensors(gathered: torch.Tensor, metadata: tuple[_ByteGatherPart, ...]) -> dict[str, torch.Tensor]:
        ...

    def _get_full_kv(self, k, attn_metadata):
        ...

    def exec_kv(self, kv_no_split: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: tuple, slots: torch.Tensor, attn_metadata: M):
        ...

    def _q_proj_and_k_up_proj(self, x):
        ...

    def _v_up_proj(self, x):
        ...

    def _sfa_preprocess_with_mlapo(self, hidden_states: torch.Tensor, kv_cache: tuple[torch.Tensor, ...], cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor, num_input_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        ...

    def _sfa_preprocess_with_prolog_v3(self, hidden_states: torch.Tensor, kv_cache: tuple[torch.Tensor, ...], cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor, cache_mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None, torch.Tensor | None, torch.Tensor | None]:
        ...

    def indexer_select_pre_process(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        ...

    def indexer_select_post_process(self, x: torch.Tensor, q_c: torch.Tensor | tuple[torch.Tensor, torch.Tensor], kv_cache: tuple[torch.Tensor, ...], attn_metadata: M, cos: torch.Tensor, sin: torch.Tensor, actual_seq_lengths_query: torch.Tensor, actual_seq_lengths_key: torch.Tensor):
        ...

    def _get_indexcache_topk_indices(self, num_tokens: int) -> torch.Tensor:
        ...

    def _update_indexcache_topk_indices(self, topk_indices: torch.Tensor) -> None:
        ...

    def _execute_sparse_flash_attention_process(self, ql_nope, q_pe, kv_cache, topk_indices, attn_metadata, actual_seq_lengths_query, actual_seq_lengths_key):
        ...

    def _record_dcp_query_gather_context(self, ql_nope: torch.Tensor, q_pe: torch.Tensor, attn_metadata: M) -> None:
        ...

    def _record_dcp_kv_gather_context(self, kv_cache: tuple[torch.Tensor, ...], attn_metadata: M) -> None:
        ...

    def forward(self, layer_name, hidden_states: torch.Tensor, kv_cache: tuple[torch.Tensor, ...], attn_metadata: M, need_gather_q_kv: bool=False, output: torch.Tensor | None=None) -> torch.Tensor:
        ...

def custom_kv_rmsnorm_rope(kv: torch.Tensor, gamma: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_lora_rank: int, qk_rope_head_dim: int, *, epsilon: float=1e-05, dst_type: torch.dtype | int=torch.float8_e4m3fn, tile_size: int=SFA_QSFA_TILE_SIZE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ...
