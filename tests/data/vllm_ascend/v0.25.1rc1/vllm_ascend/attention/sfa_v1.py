# excerpt of vllm-ascend v0.25.1rc1: vllm_ascend/attention/sfa_v1.py (signatures)
import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar
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
from vllm_ascend.attention.attention_mask import AttentionMaskBuilder
from vllm_ascend.attention.attention_v1 import AscendAttentionState
from vllm_ascend.attention.mla_v1 import MLAPO_MAX_SUPPORTED_TOKENS
from vllm_ascend.attention.utils import SFA_QSFA_TILE_SIZE, AscendCommonAttentionMetadata, ascend_chunked_prefill_workspace_size, get_sfa_qsfa_packed_head_dim, maybe_save_kv_layer_to_connector, notify_kv_cache_written, trans_rope_weight, transdata, wait_for_kv_layer_from_connector
from vllm_ascend.device.device_op import DeviceOperator
from vllm_ascend.device.mxfp_compat import FLOAT8_E8M0FNU_DTYPE
from vllm_ascend.distributed.utils import all_gather_async
from vllm_ascend.memcache_comm_fence import record_attention_compute_start
from vllm_ascend.ops.rotary_embedding import get_cos_and_sin_mla
from vllm_ascend.ops.triton.rope import rope_forward_triton_siso
from vllm_ascend.quantization.methods import AscendW8A8DynamicLinearMethod, AscendW8A8LinearMethod, AscendW8A8MXFP8DynamicLinearMethod
from vllm_ascend.utils import ACL_FORMAT_FRACTAL_ND, ACL_FORMAT_FRACTAL_NZ, AscendDeviceType, _round_up, dispose_layer, enable_dsa_cp, enable_dsa_cp_with_o_proj_tp, enable_sfa_dcp_replicated_indexer, enable_sp, get_ascend_device_type, maybe_trans_nz
from vllm_ascend.worker.npu_input_batch import NPUInputBatch

class PreprocessType(enum.Enum):
    NATIVE = 'native'
    PROLOG_V3 = 'prolog_v3'
    MLAPO = 'mlapo'

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
    dsa_cp_context: DSACPContext | None = None
    reshape_cache_event: torch.npu.Event = None
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

    def _build_with_metadata_view(self, common_attn_metadata: AscendCommonAttentionMetadata, build_metadata: Callable[[], AscendSFAMetadata]) -> AscendSFAMetadata:
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

    @property
    def kv_cache_indexer_k_idx(self) -> int:
        """Index of the indexer key cache in the KV cache tuple.

        When sparse C8 packs the SFA KV cache into a single tensor, the indexer
        key cache moves from slot 2 to slot 1:

        ================  =========  =========  =============  ==============
        Layout            kv_cache[0]  kv_cache[1]  kv_cache[2]  kv_cache[3]
        ================  =========  =========  =============  ==============
        Default           k_nope     k_pe       indexer_k      indexer_scale
        Sparse C8         packed_kv  indexer_k  indexer_scale  (unused)
        ================  =========  =========  =============  ==============
        """
        return 1 if self.use_sparse_c8_sfa else 2

    @property
    def kv_cache_indexer_scale_idx(self) -> int:
        """Index of the indexer scale cache in the KV cache tuple."""
        return 2 if self.use_sparse_c8_sfa else 3

    @staticmethod
    def update_graph_params(update_stream, forward_context, num_tokens, vllm_config=None, speculative_config=None, draft_attn_metadatas=None):
        ...

    def process_weights_after_loading(self, act_dtype: torch.dtype):
        ...

    @staticmethod
    def _get_layer_quant_method(layer: torch.nn.Module | None):
        ...

    def _resolve_preprocess_type(self, act_dtype: torch.dtype) -> PreprocessType:
        ...

    def _try_enable_type(self, pp_type: PreprocessType, act_dtype: torch.dtype) -> bool:
        ...

    def _get_fused_type_unsupported_reasons(self, pp_type: PreprocessType) -> list[str]:
        ...

    def _process_weights_for_fused_prolog_v3(self) -> None:
        ...

    def _process_weights_for_fused_mlapo(self, act_dtype: torch.dtype):
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

    def _get_full_kv(self, k, attn_metadata):
        ...

    def exec_kv(self, kv_no_split: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: tuple, slots: torch.Tensor, attn_metadata: M):
        ...

    def _q_proj_and_k_up_proj(self, x):
        ...

    def _v_up_proj(self, x):
        ...

    def _sfa_preprocess_prolog_v3(self, hidden_states: torch.Tensor, kv_cache: tuple[torch.Tensor, ...], cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None]:
        ...

    def _sfa_preprocess_mlapo(self, hidden_states: torch.Tensor, kv_cache: tuple[torch.Tensor, ...], cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor, *, num_input_tokens: int=0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None]:
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

    def _record_query_gather_context(self, ql_nope: torch.Tensor, q_pe: torch.Tensor, attn_metadata: M) -> None:
        ...

    def _maybe_gather_kv_for_dsacp(self, k_pe: torch.Tensor | None, k_nope: torch.Tensor | None, knope_scale: torch.Tensor | None, k_li: torch.Tensor | None, k_li_scale: torch.Tensor | None, full_gather_o_proj_enabled: bool) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.distributed.Work | None]:
        ...

    def _maybe_store_kvcache_for_c8_n_dsacp(self, k_pe: torch.Tensor | None, k_nope: torch.Tensor | None, knope_scale: torch.Tensor | None, k_li: torch.Tensor | None, fused_kv_no_split: torch.Tensor | None, kv_ag_handle: torch.distributed.Work | None, kv_cache: tuple[torch.Tensor, ...] | None, slot_mapping_sfa: torch.Tensor, attn_metadata: M, full_gather_o_proj_enabled: bool) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.distributed.Work | None, list[torch.distributed.Work | None] | None]:
        ...

    def _get_sfa_kv_slot_mapping(self, attn_metadata: M) -> torch.Tensor:
        ...

    def _compose_sfa_kv_cache(self, kv_cache) -> tuple[torch.Tensor, ...] | None:
        """Compose split cache handles into the tuple expected by SFA kernels.

        ``kv_cache`` contains only the main MLA cache owned by the attention
        layer, while ``self.indexer.k_cache.kv_cache`` contains the cache owned
        by the indexer layer. Their possible layouts are:

        - non-C8:
          main ``(k_cache, v_cache)`` + indexer ``(indexer_k_cache,)``
          -> ``(k_cache, v_cache, indexer_k_cache)``
        - Sparse C8:
          main ``(packed_kv_cache,)`` +
          indexer ``(indexer_k_cache, indexer_scale_cache)``
          -> ``(packed_kv_cache, indexer_k_cache, indexer_scale_cache)``

        Layers that reuse another layer's top-k indices have no local indexer;
        for those layers, the main cache tuple is returned unchanged.
        """
        main_cache = kv_cache
        if main_cache is None or not self.has_indexer:
            return main_cache
        indexer_cache = self.indexer.k_cache.kv_cache
        if indexer_cache is None:
            raise RuntimeError(f'SFA indexer cache is not initialized or bound. layer_name={self.layer_name}.')
        if self.use_sparse_c8_indexer:
            if len(indexer_cache) != 2:
                raise RuntimeError(f'Sparse C8 SFA indexer cache expects (k_cache, scale_cache), got {len(indexer_cache)} tensors for layer_name={self.layer_name}.')
            if len(main_cache) != 1:
                raise RuntimeError(f'Sparse C8 SFA main cache expects one packed KV tensor, got {len(main_cache)} tensors for layer_name={self.layer_name}.')
            return (main_cache[0], indexer_cache[0], indexer_cache[1])
        if len(indexer_cache) != 1:
            raise RuntimeError(f'SFA indexer cache expects one k_cache tensor, got {len(indexer_cache)} tensors for layer_name={self.layer_name}.')
        if len(main_cache) != 2:
            raise RuntimeError(f'SFA main cache expects (k_cache, v_cache), got {len(main_cache)} tensors for layer_name={self.layer_name}.')
        return (main_cache[0], main_cache[1], indexer_cache[0])

    def forward(self, layer_name, hidden_states: torch.Tensor, kv_cache: tuple[torch.Tensor, ...], attn_metadata: M, need_gather_q_kv: bool=False, output: torch.Tensor | None=None) -> torch.Tensor:
        ...

def custom_kv_rmsnorm_rope(kv: torch.Tensor, gamma: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_lora_rank: int, qk_rope_head_dim: int, *, epsilon: float=1e-05, dst_type: torch.dtype | int=torch.float8_e4m3fn, tile_size: int=SFA_QSFA_TILE_SIZE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ...
