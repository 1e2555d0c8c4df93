# excerpt of vllm-ascend main: vllm_ascend/worker/v2/spec_decode/autoregressive/speculator.py (signatures)
import logging
from contextlib import contextmanager
from copy import copy
from typing import Any, cast
import torch
from vllm.config import VllmConfig, get_layers_from_vllm_config
from vllm.config.compilation import CUDAGraphMode
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import AttentionBackend
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.worker.gpu.block_table import BlockTables
from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor
from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers
from vllm.v1.worker.gpu.model_states.interface import ModelState
from vllm.v1.worker.gpu.spec_decode.autoregressive.speculator import AutoRegressiveSpeculator
from vllm.v1.worker.utils import AttentionGroup
from vllm_ascend.attention.attention_v1 import AscendAttentionBackend, AscendAttentionState
from vllm_ascend.attention.dsa_v1 import AscendDSABackend
from vllm_ascend.attention.indexer import AscendSFAIndexerBackend
from vllm_ascend.attention.mla_v1 import AscendMLABackend
from vllm_ascend.attention.sfa_v1 import AscendSFABackend
from vllm_ascend.worker.v2.attn_utils import build_attn_metadata_wrapper, build_draft_attn_metadata_factory
from vllm_ascend.worker.v2.input_batch import AscendInputBuffers

class AscendAutoRegressiveSpeculator(AutoRegressiveSpeculator):

    def __init__(self, vllm_config: VllmConfig, device: torch.device):
        ...

    def init_cudagraph_manager(self, cudagraph_mode: CUDAGraphMode) -> None:
        ...

    def propose(self, input_batch: InputBatch, attn_metadata: dict[str, Any], slot_mappings: dict[str, torch.Tensor], last_hidden_states: torch.Tensor, aux_hidden_states: list[torch.Tensor] | None, num_sampled: torch.Tensor, num_rejected: torch.Tensor, last_sampled: torch.Tensor, next_prefill_tokens: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, num_tokens_across_dp: torch.Tensor | None=None, dummy_run: bool=False, skip_attn_for_dummy_run: bool=False, mm_inputs: tuple[list[torch.Tensor], torch.Tensor] | None=None, is_profile: Any=None):
        ...

    def set_attn(self, model_state: ModelState, kv_cache_config: KVCacheConfig, block_tables: BlockTables, target_input_buffers: InputBuffers, target_attn_groups: list[list[AttentionGroup]]) -> None:
        ...

    def capture(self) -> None:
        ...

    @torch.inference_mode()
    def _run_model(self, num_tokens: int, attn_metadata: dict[str, Any] | None, slot_mappings: dict[str, torch.Tensor] | None, num_tokens_across_dp: torch.Tensor | None, cudagraph_runtime_mode: CUDAGraphMode=CUDAGraphMode.NONE, mm_inputs: tuple[list[torch.Tensor], torch.Tensor] | None=None) -> tuple[torch.Tensor, torch.Tensor]:
        ...

    def _generate_draft(self, num_reqs: int, num_tokens_padded: int, attn_metadata: dict[str, Any] | None, slot_mappings: dict[str, torch.Tensor] | None, num_tokens_across_dp: torch.Tensor | None, cudagraph_runtime_mode: CUDAGraphMode=CUDAGraphMode.NONE) -> None:
        ...

    def _multi_step_decode(self, num_reqs: int, skip_attn: bool, batch_desc: BatchExecutionDescriptor, num_tokens_across_dp: torch.Tensor | None, seq_lens_cpu_upper_bound: torch.Tensor | None=None) -> None:
        ...

    def _build_draft_attn_metadata(self, num_reqs: int, num_reqs_padded: int, num_tokens_padded: int, seq_lens_cpu_upper_bound: torch.Tensor, step: int, num_query_per_req: int=1, causal: bool=True) -> dict[str, Any] | None:
        ...

    def build_draft_attn_metadatas(self, num_reqs_padded, is_draft_model_prefill):
        ...

    def _ascend_update_seq_lens(self, attn_metadata: dict[str, Any] | None) -> None:
        ...

    def _init_decode_draft_attn_metadatas(self, attn_metadata: dict[str, Any] | None, num_reqs_padded: int):
        ...

    def _update_decode_attn_metadata(self, attn_metadata: dict[str, Any] | None, step: int, num_reqs: int | None=None):
        ...

    def _calc_next_seq_lens_cpu(self, seq_lens_cpu, num_reqs, num_reqs_padded, step):
        ...

    def _get_seq_lens_cpu(self) -> torch.Tensor:
        ...

def gather(input, dim, index, *, sparse_grad=False, out=None):
    ...

@contextmanager
def torch_gather_wrapper():
    ...
