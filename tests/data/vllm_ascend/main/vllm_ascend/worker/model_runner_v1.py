# excerpt of vllm-ascend main: vllm_ascend/worker/model_runner_v1.py (runner)
import logging
import math
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from copy import copy, deepcopy
from dataclasses import dataclass, replace
from functools import partial
from multiprocessing import Manager
from typing import TYPE_CHECKING, Any, NamedTuple, TypeAlias
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from vllm._aiter_ops import rocm_aiter_ops
from vllm.compilation.cuda_graph import CUDAGraphStat
from vllm.config import CompilationMode, CUDAGraphMode, VllmConfig, get_layers_from_vllm_config
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.distributed.ec_transfer import get_ec_transfer, has_ec_transfer
from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
from vllm.distributed.parallel_state import get_dcp_group, get_dp_group, get_pp_group, get_tp_group, model_parallel_is_initialized
from vllm.forward_context import BatchDescriptor, ForwardContext, get_forward_context
from vllm.logger import logger
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.model_loader import get_model
from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer
from vllm.model_executor.offloader.base import get_offloader, set_offloader
from vllm.sequence import IntermediateTensors
from vllm.utils.import_utils import LazyLoader
from vllm.utils.math_utils import cdiv, round_up
from vllm.utils.mem_utils import DeviceMemoryProfiler
from vllm.utils.torch_utils import PIN_MEMORY, get_dtype_size
from vllm.v1.attention.backend import AttentionBackend, AttentionCGSupport, AttentionMetadata, MultipleOf
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder
from vllm.v1.attention.backends.utils import CommonAttentionMetadata
from vllm.v1.attention.selector import get_attn_backend
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import AttentionSpec, EncoderOnlyAttentionSpec, HiddenStateCacheSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheSpec, MambaSpec, UniformTypeKVCacheSpecs
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, AsyncModelRunnerOutput, DraftTokenIds, ECConnectorOutput, LogprobsLists, LogprobsTensors, ModelRunnerOutput, RoutedExpertsLists, RoutedExpertsTensors, SamplerOutput, make_empty_encoder_model_runner_output
from vllm.v1.sample.logits_processor import build_logitsprocs
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
from vllm.v1.spec_decode.ngram_proposer_gpu import copy_num_valid_draft_tokens
from vllm.v1.structured_output.utils import apply_grammar_bitmask
from vllm.v1.utils import record_function_or_nullcontext
from vllm.v1.worker import mamba_utils
from vllm.v1.worker.gpu_model_runner import AsyncGPUModelRunnerOutput, GPUModelRunner
from vllm.v1.worker.ubatch_utils import UBatchSlices, maybe_create_ubatch_slices
from vllm.v1.worker.utils import AttentionGroup, select_common_block_size
from vllm_ascend.ascend_config import get_ascend_config
from vllm_ascend.attention.attention_v1 import AscendAttentionBackend, AscendAttentionState
from vllm_ascend.attention.context_parallel.dsa_cp import AscendDSACPMetadataBuilder
from vllm_ascend.attention.context_parallel.sfa_cp import AscendSFADCPMetadataBuilder
from vllm_ascend.attention.dsa_v1 import AscendDSAMetadataBuilder
from vllm_ascend.attention.mla_v1 import AscendMLABackend
from vllm_ascend.attention.utils import AscendCommonAttentionMetadata, get_sfa_qsfa_packed_head_dim, using_paged_attention
from vllm_ascend.compilation.acl_graph import ACLGraphWrapper, set_draft_graph_params, set_graph_params, update_full_graph_params
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.layerwise_cache_layout import apply_layerwise_kv_cache_plan
from vllm_ascend.distributed.kv_transfer.sparse_kv_offload.sparse_kv_offload_manager import allocate_kv_cache_tensors_for_sparse_kv_offload, allocate_kv_offload_topk_profile_buffers, init_sparse_kv_offload_manager, reshape_kv_cache_tensors_for_sparse_kv_offload, update_sparse_kv_offload_metadata
from vllm_ascend.distributed.utils import get_decode_context_model_parallel_world_size
from vllm_ascend.eplb.adaptor.vllm_adaptor import VllmEplbAdaptor
from vllm_ascend.eplb.core.eplb_device_transfer_loader import D2DExpertWeightLoader
from vllm_ascend.eplb.core.eplb_worker import EplbProcess
from vllm_ascend.eplb.eplb_updator import EplbUpdator
from vllm_ascend.model_executor.offloader import create_offloader
from vllm_ascend.ops.rotary_embedding import set_cos_and_sin, update_cos_sin
from vllm_ascend.ops.triton.spec_decode.ngram import triton_ngram_spec_decode
from vllm_ascend.quantization.utils import enable_fa_quant
from vllm_ascend.sample.sampler import AscendSampler
from vllm_ascend.spec_decode import get_spec_decode_method
from vllm_ascend.spec_decode.dflash_proposer import AscendDflashProposer
from vllm_ascend.spec_decode.draft_proposer import AscendDraftModelProposer
from vllm_ascend.spec_decode.dspark_proposer import AscendDSparkProposer
from vllm_ascend.spec_decode.eagle_proposer import AscendEagleProposer
from vllm_ascend.spec_decode.extract_hidden_states_proposer import AscendExtractHiddenStatesProposer
from vllm_ascend.spec_decode.medusa_proposer import AscendMedusaProposer
from vllm_ascend.spec_decode.ngram_proposer import AscendNgramProposer
from vllm_ascend.spec_decode.ngram_proposer_npu import AscendNgramProposerNPU
from vllm_ascend.spec_decode.step3p5 import AscendStep3p5MTPProposer
from vllm_ascend.spec_decode.suffix_proposer import AscendSuffixDecodingProposer
from vllm_ascend.spec_decode.utils import correct_optimistic_seq_lens_cpu, update_num_computed_tokens_for_batch_change
from vllm_ascend.utils import AscendDeviceType, calc_split_factor, check_gdn_layer, embedding_tp_enable, enable_dsa_cp, enable_sfa, enable_sfa_dcp_replicated_indexer, enable_sp, get_ascend_device_type, get_c_env, global_stream, is_hidden_state_cache_spec, kv_cache_spec_uses_sparse_sfa_c8, lmhead_tp_enable, oproj_tp_enable, set_potential_max_tokens, should_skip_allreduce_across_dp_group, vllm_version_is
from vllm_ascend.worker.dcp_utils import DCPAsyncSpecDecodeRebuildResult, DCPManager
from vllm_ascend.worker.npu_input_batch import NPUInputBatch
from vllm_ascend.worker.utils import AscendKVBlockZeroer
from vllm_ascend.ascend_forward_context import MoECommType, get_mc2_tokens_capacity, select_moe_comm_method, set_ascend_forward_context, set_mc2_mask, set_mc2_tokens_capacity
from vllm.model_executor.models.interfaces import supports_multimodal_pruning
from vllm_ascend.sample.rejection_sampler import AscendRejectionSampler
from vllm.model_executor.layers.attention import Attention, MLAAttention
from vllm_ascend.core.kv_cache_interface import AscendMLAAttentionSpec, AscendSFAIndexerCacheSpec, AscendSlidingWindowMLASpec

class NPUModelRunner(GPUModelRunner):

    def _set_up_drafter(self):
        self.drafter: AscendNgramProposer | AscendNgramProposerNPU | AscendEagleProposer | AscendStep3p5MTPProposer | AscendDraftModelProposer | AscendDflashProposer | AscendDSparkProposer | AscendSuffixDecodingProposer | AscendMedusaProposer | AscendExtractHiddenStatesProposer | None = None
        self.actual_seq_lengths_q: list[int] = []
        self.decode_token_per_req = 1
        if self.speculative_config:
            spec_token_num = self.speculative_config.num_speculative_tokens
            assert spec_token_num > 0
            self.decode_token_per_req = 1 + spec_token_num
            if get_pp_group().is_last_rank:
                self.drafter = self._get_drafter()
                if self.speculative_config.method == 'eagle3':
                    assert isinstance(self.drafter, AscendEagleProposer)
                    self.use_aux_hidden_state_outputs = self.drafter.eagle3_use_aux_hidden_state
                elif self.speculative_config.method == 'extract_hidden_states':
                    assert isinstance(self.drafter, AscendExtractHiddenStatesProposer)
                    self.use_aux_hidden_state_outputs = True
                elif self.speculative_config.use_dspark():
                    assert isinstance(self.drafter, AscendDSparkProposer)
                    self.use_aux_hidden_state_outputs = True
                self.rejection_sampler = AscendRejectionSampler(self.sampler, self.speculative_config, self.device)
        self.discard_request_indices = self._make_buffer(self.max_num_reqs, dtype=torch.int64)
        self.num_discarded_requests = 0

    def _get_drafter(self):
        return get_spec_decode_method(self.speculative_config.method, self.vllm_config, self.device, self)

    def _sync_metadata_across_dp(self, num_tokens: int, is_draft_model: bool=False, cudagraph_mode: CUDAGraphMode=CUDAGraphMode.NONE, allow_dp_padding: bool=False) -> tuple[int, torch.Tensor | None, CUDAGraphMode]:
        if self.dp_size == 1:
            return (num_tokens, None, cudagraph_mode)
        if should_skip_allreduce_across_dp_group(self.vllm_config, is_draft_model):
            num_tokens_after_padding = torch.tensor([num_tokens] * self.dp_size, device='cpu', dtype=torch.int32)
            return (num_tokens, num_tokens_after_padding, cudagraph_mode)
        packed_tensor = torch.zeros(2, self.dp_size, device='cpu', dtype=torch.int32)
        packed_tensor[0][self.dp_rank] = num_tokens
        packed_tensor[1][self.dp_rank] = cudagraph_mode.value
        dist.all_reduce(packed_tensor, group=get_dp_group().cpu_group)
        num_tokens_across_dp = packed_tensor[0, :]
        max_tokens_across_dp = int(num_tokens_across_dp.max().item())
        synced_cudagraph_mode = CUDAGraphMode(_post_process_cudagraph_mode(packed_tensor))
        if allow_dp_padding or is_draft_model:
            num_tokens_after_padding = torch.tensor([max_tokens_across_dp] * self.dp_size, device='cpu', dtype=torch.int32)
        else:
            num_tokens_after_padding = num_tokens_across_dp.cpu()
        return (max_tokens_across_dp, num_tokens_after_padding, synced_cudagraph_mode)

    def propose_draft_token_ids(self, valid_sampled_token_ids: torch.Tensor | list[list[int]], sampling_metadata: SamplingMetadata, scheduler_output: 'SchedulerOutput', spec_decode_metadata: SpecDecodeMetadata, spec_decode_common_attn_metadata: AscendCommonAttentionMetadata, positions: torch.Tensor, num_scheduled_tokens: int, hidden_states: torch.Tensor, aux_hidden_states: torch.Tensor=None, sample_hidden_states: torch.Tensor=None, target_model_batch_desc: BatchDescriptor=None) -> list[list[int]] | None:
        self._log_propose_draft_token_ids_entry(spec_decode_metadata, num_scheduled_tokens)
        if not self.drafter:
            draft_token_ids = None
        elif isinstance(self.drafter, AscendNgramProposer):
            draft_token_ids = self.drafter.propose(scheduler_output.num_spec_tokens_to_schedule, valid_sampled_token_ids, self.input_batch.num_tokens_no_spec, self.input_batch.token_ids_cpu)
        elif isinstance(self.drafter, AscendSuffixDecodingProposer):
            draft_token_ids = self.drafter.propose(num_speculative_tokens=scheduler_output.num_spec_tokens_to_schedule, sampled_token_ids=valid_sampled_token_ids)
        elif isinstance(self.drafter, AscendNgramProposerNPU):
            batch_size = min(self.input_batch.num_reqs, self.token_ids_gpu_tensor.shape[0])
            vocab_size = self.model_config.get_vocab_size()
            next_token_ids, draft_token_ids, num_valid_draft_tokens, valid_sampled_tokens_count = triton_ngram_spec_decode(self.token_ids_gpu_tensor[:batch_size], self.num_tokens_no_spec_gpu[:batch_size], valid_sampled_token_ids, self.discard_request_mask.gpu[:batch_size], vocab_size=vocab_size, min_n=self.drafter.min_n, max_n=self.drafter.max_n, k=self.drafter.k)
            self._copy_valid_sampled_token_count(next_token_ids, valid_sampled_tokens_count)
            self._num_valid_draft_tokens = num_valid_draft_tokens
            copy_num_valid_draft_tokens(self._num_valid_draft_tokens_cpu, self._num_valid_draft_tokens_copy_stream, self._num_valid_draft_tokens_event, self._num_valid_draft_tokens, batch_size)
        elif isinstance(self.drafter, AscendMedusaProposer):
            draft_token_ids = self.drafter.propose(scheduler_output.num_spec_tokens_to_schedule, valid_sampled_token_ids, sampling_metadata, spec_decode_metadata, sample_hidden_states)
        elif self.speculative_config.uses_extract_hidden_states():
            assert isinstance(self.drafter, AscendExtractHiddenStatesProposer)
            assert isinstance(valid_sampled_token_ids, torch.Tensor), 'sampled_token_ids should be a torch.Tensor for extract_hidden_states method.'
            if not self.use_aux_hidden_state_outputs or aux_hidden_states is None:
                raise ValueError('aux_hidden_states are required when using `extract_hidden_states`')
            common_attn_metadata = spec_decode_common_attn_metadata
            target_hidden_states = [h[:num_scheduled_tokens] for h in aux_hidden_states]
            draft_token_ids = self.drafter.propose(scheduler_output.num_spec_tokens_to_schedule, sampled_token_ids=valid_sampled_token_ids, target_hidden_states=target_hidden_states, common_attn_metadata=common_attn_metadata)
            next_token_ids, valid_sampled_tokens_count = self.drafter.prepare_next_token_ids_padded(valid_sampled_token_ids, self.requests, self.input_batch, self.discard_request_indices.gpu, self.num_discarded_requests)
            self._copy_valid_sampled_token_count(next_token_ids, valid_sampled_tokens_count)
        elif self.speculative_config.use_eagle() or self.speculative_config.uses_draft_model():
            common_attn_metadata = spec_decode_common_attn_metadata
            sampled_token_ids = valid_sampled_token_ids
            if self.vllm_config.speculative_config.disable_padded_drafter_batch:
                assert isinstance(sampled_token_ids, list), 'sampled_token_ids should be a python list whenpadded-batch is disabled.'
                assert self.drafter is not None
                next_token_ids = self.drafter.prepare_next_token_ids_cpu(sampled_token_ids, self.requests, self.input_batch, scheduler_output.num_scheduled_tokens)
            else:
                assert isinstance(sampled_token_ids, torch.Tensor), 'sampled_token_ids should be a torch.Tensor whenpadded-batch is enabled.'
                assert self.drafter is not None
                next_token_ids, valid_sampled_tokens_count = self.drafter.prepare_next_token_ids_padded(sampled_token_ids, self.requests, self.input_batch, self.discard_request_indices.gpu, self.num_discarded_requests)
                self._copy_valid_sampled_token_count(next_token_ids, valid_sampled_tokens_count)
            req_scheduled_tokens = scheduler_output.num_scheduled_tokens
            if self.use_dcp:
                long_seq_metadata = self.long_seq_metadata
                num_prefill_reqs = self.dcp_manager.num_prefill_reqs
                num_decode_reqs = self.dcp_manager.num_decode_reqs
            else:
                long_seq_metadata = None
                num_prefill_reqs = 0
                num_decode_reqs = 0
            mtp_hidden_states = getattr(self.get_model(), 'get_mtp_target_hidden_states', lambda: None)()
            if self.speculative_config.method == 'mtp' and mtp_hidden_states is not None:
                hidden_states = mtp_hidden_states
            num_rejected_tokens_gpu = None
            if spec_decode_metadata is None:
                token_indices_to_sample = None
                target_token_ids = self.input_ids.gpu[:num_scheduled_tokens]
                target_positions = self._get_positions(num_scheduled_tokens)
                if self.use_aux_hidden_state_outputs:
                    target_hidden_states = torch.cat([h[:num_scheduled_tokens] for h in aux_hidden_states], dim=-1)
                else:
                    target_hidden_states = hidden_states[:num_scheduled_tokens]
            else:
                if self.vllm_config.speculative_config.disable_padded_drafter_batch:
                    token_indices_to_sample = None
                    assert self.drafter is not None
                    common_attn_metadata, token_indices = self.drafter.prepare_inputs(common_attn_metadata, sampled_token_ids, spec_decode_metadata.num_draft_tokens)
                else:
                    assert self.drafter is not None
                    common_attn_metadata, token_indices, token_indices_to_sample, num_rejected_tokens_gpu = self.drafter.prepare_inputs_padded(common_attn_metadata, spec_decode_metadata, valid_sampled_tokens_count)
                target_token_ids = self.input_ids.gpu[token_indices]
                target_positions = self._get_positions(token_indices)
                if self.use_aux_hidden_state_outputs:
                    target_hidden_states = torch.cat([h[token_indices] for h in aux_hidden_states], dim=-1)
                else:
                    target_hidden_states = hidden_states[token_indices]
            assert self.drafter is not None
            draft_token_ids = self.drafter._propose(num_speculative_tokens=scheduler_output.num_spec_tokens_to_schedule, target_token_ids=target_token_ids, target_positions=target_positions, target_hidden_states=target_hidden_states, next_token_ids=next_token_ids, token_indices_to_sample=token_indices_to_sample, common_attn_metadata=common_attn_metadata, target_model_batch_desc=target_model_batch_desc, sampling_metadata=sampling_metadata, req_scheduled_tokens=req_scheduled_tokens, long_seq_metadata=long_seq_metadata, num_prefill_reqs=num_prefill_reqs, num_decode_reqs=num_decode_reqs, scheduler_output=scheduler_output, num_scheduled_tokens=num_scheduled_tokens, num_rejected_tokens_gpu=num_rejected_tokens_gpu)
            if get_pp_group().world_size > 1 and hasattr(self.drafter, 'take_last_draft_probs'):
                draft_probs = self.drafter.take_last_draft_probs()
                if draft_probs is not None:
                    self._draft_probs = draft_probs
                    self._draft_prob_req_ids = self.input_batch.req_ids.copy()
        else:
            raise ValueError(f'Unknown speculative decoding method: {self.speculative_config.method}')
        return draft_token_ids

    def _log_propose_draft_token_ids_entry(self, spec_decode_metadata: SpecDecodeMetadata, num_scheduled_tokens: int) -> None:
        """DFX entry probe for propose_draft_token_ids.

        Records which speculative-decoding sub-path is about to run
        (ngram / medusa / eagle / extract_hidden_states / ...). When the
        `Unknown speculative decoding method` ValueError fires further down,
        or when end-to-end speedup is unexpectedly absent, this tells the
        operator which drafter object was actually constructed and whether k
        (num_speculative_tokens) is non-trivial. Type lookups and getattr are
        host-only; gated by isEnabledFor(DEBUG).
        """
        if not logger.isEnabledFor(logging.DEBUG):
            return
        drafter_type = type(self.drafter).__name__ if self.drafter else None
        spec_meta_state = 'None' if spec_decode_metadata is None else f'max_spec_len={spec_decode_metadata.max_spec_len}'
        logger.debug('[spec/dfx] propose_draft_token_ids entry: drafter=%s, method=%s, k=%d, num_reqs=%d, num_scheduled_tokens=%d, spec_decode_metadata=%s, use_dcp=%s, dcp_size=%d', drafter_type, self.speculative_config.method if self.speculative_config else None, self.num_spec_tokens, self.input_batch.num_reqs, num_scheduled_tokens, spec_meta_state, getattr(self, 'use_dcp', False), getattr(self, 'dcp_size', 1))

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        out = super().take_draft_token_ids()
        if out is None:
            return None
        dynamic_spec = getattr(self.drafter, 'dynamic_spec', None)
        if dynamic_spec is None:
            return out
        per_req_k = dynamic_spec.num_verify_tokens
        if per_req_k is None:
            return out
        per_req_k = [max(0, min(int(k), self.num_spec_tokens)) for k in per_req_k]
        cut_tokens = DraftTokenIds(req_ids=out.req_ids, draft_token_ids=[tokens[:k] for tokens, k in zip(out.draft_token_ids, per_req_k)])
        return cut_tokens

    def _build_attention_metadata(self, num_tokens: int, num_reqs: int, max_query_len: int, num_tokens_padded: int | None=None, num_reqs_padded: int | None=None, ubatch_slices: UBatchSlices | None=None, logits_indices: torch.Tensor | None=None, use_spec_decode: bool=False, for_cudagraph_capture: bool=False, num_scheduled_tokens: dict[str, int] | None=None, num_scheduled_tokens_np: np.ndarray | None=None, cascade_attn_prefix_lens: list[list[int]] | None=None) -> tuple[PerLayerAttnMetadata, CommonAttentionMetadata | None]:
        """
        :return: tuple[attn_metadata, spec_decode_common_attn_metadata]
        """
        if len(self.kv_cache_config.kv_cache_groups) == 0:
            return ({}, None)
        num_tokens_padded = num_tokens_padded or num_tokens
        num_reqs_padded = num_reqs_padded or num_reqs
        if self.sparse_kv_offload_enabled:
            update_sparse_kv_offload_metadata(num_tokens, num_reqs, num_tokens_padded, num_reqs_padded, self.input_batch.req_ids[:num_reqs], self.query_start_loc, self._offload_req_ids_tensor, self._offload_token_to_req)
        attn_metadata: PerLayerAttnMetadata = {}
        if ubatch_slices is not None:
            attn_metadata = [dict() for _ in range(len(ubatch_slices))]
        if for_cudagraph_capture:
            max_seq_len = self.max_model_len
        else:
            max_seq_len = self.optimistic_seq_lens_cpu.numpy()[:num_reqs].max().item()
        kv_cache_groups = self.kv_cache_config.kv_cache_groups

        def _get_dcp_metadata(block_table_tensor):
            if not self.use_dcp:
                return (None, block_table_tensor)
            fixed_decode_seq_lens_cpu = None
            if self.use_async_spec_decode:
                fixed_decode_seq_lens_cpu = self.optimistic_seq_lens_cpu[:num_reqs].numpy()
            assert num_reqs_padded is not None
            return self.dcp_manager.generate_dcp_metadata(num_tokens, self.query_lens, self.input_batch, num_scheduled_tokens_np, block_table_tensor, num_reqs_padded, num_reqs, fixed_decode_seq_lens_cpu)

        def _get_block_table_and_slot_mapping(kv_cache_gid: int):
            assert num_reqs_padded is not None and num_tokens_padded is not None
            kv_cache_spec = kv_cache_groups[kv_cache_gid].kv_cache_spec
            if isinstance(kv_cache_spec, EncoderOnlyAttentionSpec):
                blk_table_tensor = torch.zeros((num_reqs_padded, 1), dtype=torch.int32, device=self.device)
                slot_mapping = torch.zeros((num_tokens_padded,), dtype=torch.int64, device=self.device)
            else:
                blk_table = self.input_batch.block_table[kv_cache_gid]
                slot_mapping = blk_table.slot_mapping.gpu[:num_tokens_padded]
                blk_table_tensor = blk_table.get_device_tensor()[:num_reqs_padded]
                slot_mapping[num_tokens:num_tokens_padded].fill_(-1)
                blk_table_tensor[num_reqs:num_reqs_padded].fill_(0)
            if self.model_config.enable_return_routed_experts and kv_cache_gid == 0:
                if self.routed_experts_initialized:
                    n = slot_mapping.shape[0]
                    self.routed_experts_slot_mapping_device[:n].copy_(slot_mapping)
            return (blk_table_tensor, slot_mapping)
        block_table_gid_0, slot_mapping_gid_0 = _get_block_table_and_slot_mapping(0)
        self.long_seq_metadata, block_table_gid_0 = _get_dcp_metadata(block_table_gid_0)
        num_computed_tokens_cpu = self.input_batch.num_computed_tokens_cpu_tensor[:num_reqs_padded]
        num_prompt_tokens_cpu = self.input_batch.num_prompt_tokens_cpu_tensor[:num_reqs_padded]
        is_prefilling = num_computed_tokens_cpu < num_prompt_tokens_cpu
        is_prefilling[num_reqs:] = False
        seq_lens_cpu = self.optimistic_seq_lens_cpu[:num_reqs_padded]
        if self.use_async_spec_decode:
            seq_lens_cpu = None
            num_computed_tokens_cpu = None
        cm_base = AscendCommonAttentionMetadata(query_start_loc=self.query_start_loc.gpu[:num_reqs_padded + 1], query_start_loc_cpu=self.query_start_loc.cpu[:num_reqs_padded + 1], seq_lens=self.seq_lens[:num_reqs_padded], _seq_lens_cpu=self.optimistic_seq_lens_cpu[:num_reqs_padded], seq_lens_cpu_upper_bound=self.optimistic_seq_lens_cpu[:num_reqs_padded], seq_lens_cpu=seq_lens_cpu, num_computed_tokens_cpu=num_computed_tokens_cpu, num_reqs=num_reqs_padded, num_actual_tokens=num_tokens, max_query_len=max_query_len, max_seq_len=max_seq_len, block_table_tensor=block_table_gid_0, slot_mapping=slot_mapping_gid_0, causal=True, is_prefilling=is_prefilling, num_input_tokens=num_tokens_padded, actual_seq_lengths_q=self.actual_seq_lengths_q, positions=self.positions, positions_cpu=self._dsa_positions_cpu_buf if self.use_compress else None, attn_state=self.attn_state, decode_token_per_req=self.decode_token_per_req, context_parallel_metadata=self.long_seq_metadata, group_len=self.group_len.gpu[:num_reqs_padded], group_key_idx=self.group_key_idx.gpu[:num_reqs_padded], group_key_cache_idx=self.group_key_cache_idx.gpu[:num_reqs_padded], req_ids_tensor=self._offload_req_ids_tensor.gpu[:num_reqs_padded] if self._offload_req_ids_tensor is not None else None, token_to_req=self._offload_token_to_req.gpu[:num_tokens_padded] if self._offload_token_to_req is not None else None)
        if logits_indices is not None and self.cache_config.kv_sharing_fast_prefill:
            cm_base.num_logits_indices = logits_indices.size(0)
            cm_base.logits_indices_padded = self._prepare_kv_sharing_fast_prefill(logits_indices)

        def _build_attn_group_metadata(kv_cache_gid: int, attn_gid: int, common_attn_metadata: CommonAttentionMetadata, common_ratio_to_sas_metadata: dict, ubid: int | None=None) -> None:
            attn_group = self.attn_groups[kv_cache_gid][attn_gid]
            builder = attn_group.get_metadata_builder(ubid or 0)
            cascade_attn_prefix_len = cascade_attn_prefix_lens[kv_cache_gid][attn_gid] if cascade_attn_prefix_lens else 0
            extra_attn_metadata_args = {}
            if use_spec_decode and isinstance(builder, GDNAttentionMetadataBuilder):
                assert ubid is None, 'UBatching not supported with GDN yet'
                extra_attn_metadata_args = dict(num_accepted_tokens=self.num_accepted_tokens.gpu[:num_reqs_padded], num_decode_draft_tokens_cpu=self.num_decode_draft_tokens.cpu[:num_reqs_padded])
            if isinstance(builder, (AscendDSAMetadataBuilder, AscendDSACPMetadataBuilder)):
                if for_cudagraph_capture:
                    common_ratio_to_sas_metadata = {}
                extra_attn_metadata_args = dict(num_reqs_actual=num_reqs, common_ratio_to_sas_metadata=common_ratio_to_sas_metadata)
            if for_cudagraph_capture and (not isinstance(builder, (AscendDSAMetadataBuilder, AscendDSACPMetadataBuilder, AscendSFADCPMetadataBuilder))):
                attn_metadata_i = builder.build_for_cudagraph_capture(common_attn_metadata)
            else:
                attn_metadata_i = builder.build(common_prefix_len=cascade_attn_prefix_len, common_attn_metadata=common_attn_metadata, **extra_attn_metadata_args)
                if self.vllm_config.compilation_config.cudagraph_mode.has_full_cudagraphs() and isinstance(builder, GDNAttentionMetadataBuilder) and (attn_metadata_i.num_prefills == 0):
                    if attn_metadata_i.num_decodes == 0 and attn_metadata_i.num_spec_decodes > 0:
                        attn_metadata_i.spec_state_indices_tensor[attn_metadata_i.num_spec_decodes:].fill_(0)
            if isinstance(builder, AscendDSAMetadataBuilder):
                common_ratio_to_sas_metadata = builder.common_ratio_to_sas_metadata
            if ubid is None:
                assert isinstance(attn_metadata, dict)
                attn_metadata_dict = attn_metadata
            else:
                assert isinstance(attn_metadata, list)
                attn_metadata_dict = attn_metadata[ubid]
            for layer_name in attn_group.layer_names:
                attn_metadata_dict[layer_name] = attn_metadata_i
        common_ratio_to_sas_metadata: dict[Any, Any] = {}
        spec_decode_common_attn_metadata = None
        for kv_cache_gid, kv_cache_group in enumerate(self.kv_cache_config.kv_cache_groups):
            cm = copy(cm_base)
            cm.encoder_seq_lens, cm.encoder_seq_lens_cpu = self._get_encoder_seq_lens(num_scheduled_tokens or {}, kv_cache_group.kv_cache_spec, num_reqs_padded)
            if self._has_gdn:
                attn_group = self.attn_groups[kv_cache_gid][0]
                builder = attn_group.get_metadata_builder(0)
                if isinstance(builder, GDNAttentionMetadataBuilder):
                    cm.query_start_loc_cpu = self.gdn_query_start_loc.cpu[:num_reqs_padded + 1]
                    cm.query_start_loc = self.gdn_query_start_loc.gpu[:num_reqs_padded + 1]
            if kv_cache_gid > 0:
                cm.block_table_tensor, cm.slot_mapping = _get_block_table_and_slot_mapping(kv_cache_gid)
            if self.speculative_config and isinstance(self.drafter, (AscendStep3p5MTPProposer, AscendDSparkProposer)):
                self.drafter.set_per_group_attn_metadata(kv_cache_gid, cm.block_table_tensor, cm.slot_mapping)
            if self.speculative_config and spec_decode_common_attn_metadata is None:
                if isinstance(self.drafter, AscendEagleProposer | AscendDraftModelProposer | AscendDflashProposer | AscendDSparkProposer):
                    if self.drafter.attn_layer_names[0] in kv_cache_group.layer_names:
                        spec_decode_common_attn_metadata = cm
                elif isinstance(self.drafter, AscendExtractHiddenStatesProposer):
                    if self.drafter.kv_cache_gid == kv_cache_gid:
                        spec_decode_common_attn_metadata = cm
                else:
                    spec_decode_common_attn_metadata = cm
            for attn_gid in range(len(self.attn_groups[kv_cache_gid])):
                _build_attn_group_metadata(kv_cache_gid, attn_gid, cm, common_ratio_to_sas_metadata)
        if self.is_mm_prefix_lm:
            req_doc_ranges = {}
            for req_id in self.input_batch.req_ids:
                image_doc_ranges = []
                req_state = self.requests[req_id]
                for mm_feature in req_state.mm_features:
                    pos_info = mm_feature.mm_position
                    img_doc_range = pos_info.extract_embeds_range()
                    image_doc_ranges.extend(img_doc_range)
                req_idx = self.input_batch.req_id_to_index[req_id]
                req_doc_ranges[req_idx] = image_doc_ranges
            if isinstance(attn_metadata, list):
                for ub_metadata in attn_metadata:
                    for _metadata in ub_metadata.values():
                        _metadata.mm_prefix_range = req_doc_ranges
            else:
                for _metadata in attn_metadata.values():
                    _metadata.mm_prefix_range = req_doc_ranges
        if spec_decode_common_attn_metadata is not None and (num_reqs != num_reqs_padded or num_tokens != num_tokens_padded):
            spec_decode_common_attn_metadata = spec_decode_common_attn_metadata.unpadded(num_tokens, num_reqs)
        return (attn_metadata, spec_decode_common_attn_metadata)

    @torch.inference_mode()
    def _dummy_run(self, num_tokens: int, with_prefill: bool=False, cudagraph_runtime_mode: CUDAGraphMode | None=None, force_attention: bool=False, uniform_decode: bool=False, is_profile: bool=False, create_mixed_batch: bool=False, allow_microbatching: bool=True, skip_eplb: bool=False, remove_lora: bool=True, is_graph_capturing: bool=False, num_active_loras: int=0, profile_seq_lens: int | None=None, profile_cpp: bool=False) -> tuple[torch.Tensor, torch.Tensor]:
        assert cudagraph_runtime_mode is None or cudagraph_runtime_mode.valid_runtime_modes()
        max_query_len = self.uniform_decode_query_len if uniform_decode else num_tokens
        assert num_tokens <= self.scheduler_config.max_num_batched_tokens
        max_num_reqs = self.scheduler_config.max_num_seqs
        if create_mixed_batch:
            raise NotImplementedError('create_mixed_batch is used for warmup deepgemm, vllm-ascend does not need it')
        elif uniform_decode:
            num_reqs = min(max_num_reqs, cdiv(num_tokens, max_query_len))
            num_scheduled_tokens_list = [max_query_len] * num_reqs
            if num_tokens % max_query_len != 0:
                num_scheduled_tokens_list[-1] = num_tokens % max_query_len
        elif profile_cpp:
            num_reqs = 1
            num_scheduled_tokens_list = [num_tokens] * num_reqs
        else:
            num_reqs = min(num_tokens, max_num_reqs)
            min_tokens_per_req = num_tokens // num_reqs
            num_scheduled_tokens_list = [min_tokens_per_req] * num_reqs
            num_scheduled_tokens_list[-1] += num_tokens % num_reqs
        assert sum(num_scheduled_tokens_list) == num_tokens
        assert len(num_scheduled_tokens_list) == num_reqs
        if not is_profile and self.dynamic_eplb:
            self.eplb_updator.forward_before()
        num_scheduled_tokens = np.array(num_scheduled_tokens_list, dtype=np.int32)
        self.query_lens = torch.from_numpy(num_scheduled_tokens)
        num_tokens_unpadded = int(num_scheduled_tokens.sum())
        num_sampled_tokens = np.ones(num_reqs, dtype=np.int32)
        _cudagraph_mode, batch_desc, _, num_tokens_across_dp, _ = self._determine_batch_execution_and_padding(num_tokens=num_tokens_unpadded, num_reqs=num_reqs, num_scheduled_tokens_np=num_scheduled_tokens, max_num_scheduled_tokens=max_query_len, use_cascade_attn=False, allow_microbatching=allow_microbatching, force_eager=is_profile or cudagraph_runtime_mode == CUDAGraphMode.NONE or profile_cpp, force_uniform_decode=uniform_decode, force_has_lora=num_active_loras > 0, force_num_active_loras=num_active_loras)
        if self.use_dcp:
            self.dcp_manager.init_batch_info(num_scheduled_tokens, num_reqs, self.input_batch.num_computed_tokens_cpu, self.input_batch.num_prompt_tokens)
            if self.speculative_config:
                self.dcp_manager.query_lens_full.cpu[:num_reqs] = torch.from_numpy(num_scheduled_tokens)
                self.dcp_manager.query_lens_full.copy_to_gpu()
        if cudagraph_runtime_mode is None:
            cudagraph_runtime_mode = _cudagraph_mode
        else:
            assert cudagraph_runtime_mode == _cudagraph_mode, f'Cudagraph runtime mode mismatch in dummy_run. Expected {_cudagraph_mode}, but got {cudagraph_runtime_mode}.'
        num_tokens_padded = batch_desc.num_tokens
        num_reqs_padded = batch_desc.num_reqs if batch_desc.num_reqs is not None else num_reqs
        if num_tokens_across_dp is not None and num_tokens_padded != num_tokens:
            num_tokens_across_dp[:] = num_tokens_padded
            num_scheduled_tokens = num_scheduled_tokens.repeat(num_reqs_padded)
        if self.dynamic_eplb:
            self.update_eplb_heat_collection_status(num_tokens_padded)
        ubatch_slices, ubatch_slices_padded = (None, None)
        attn_metadata: PerLayerAttnMetadata | None = None
        with self.synchronize_input_prep():
            if self._should_build_dummy_attn_metadata(force_attention, is_profile, cudagraph_runtime_mode):
                if create_mixed_batch:
                    raise NotImplementedError('create_mixed_batch is used for warmup deepgemm, vllm-ascend does not need it')
                self.attn_state = AscendAttentionState.DecodeOnly
                if self.speculative_config and self.speculative_config.method == 'mtp':
                    if self.vllm_config.model_config.use_mla:
                        self.attn_state = AscendAttentionState.SpecDecoding
                    else:
                        self.attn_state = AscendAttentionState.ChunkedPrefill
                if profile_seq_lens is not None:
                    seq_lens = profile_seq_lens
                else:
                    seq_lens = SEQ_LEN_WITH_MAX_PA_WORKSPACE if is_graph_capturing and using_paged_attention(num_tokens, self.vllm_config) else max_query_len
                self.optimistic_seq_lens_cpu[:num_reqs] = seq_lens
                self.optimistic_seq_lens_cpu[num_reqs:].fill_(0)
                self.seq_lens.copy_(self.optimistic_seq_lens_cpu, non_blocking=True)
                cum_num_tokens = self._get_cumsum_and_arange(num_scheduled_tokens, self.query_pos.np)
                self.query_start_loc.np[1:num_reqs_padded + 1] = cum_num_tokens
                self.query_start_loc.copy_to_gpu()
                if self._has_gdn:
                    self.gdn_query_start_loc.np[1:num_reqs_padded + 1] = cum_num_tokens
                    self.gdn_query_start_loc.copy_to_gpu()
                if not profile_cpp:
                    num_reqs_padded = self._pad_query_start_loc_for_fia(self.query_start_loc, num_tokens_padded, num_reqs_padded, num_reqs, cudagraph_runtime_mode, batch_desc.num_reqs)
                self.input_batch.block_table.commit_block_table(num_reqs_padded)
                pad_attn = cudagraph_runtime_mode == CUDAGraphMode.FULL
                if self.use_compress:
                    self.positions.fill_(127)
                    self._dsa_positions_cpu_buf.fill_(127)
                attn_metadata, _ = self._build_attention_metadata(num_tokens=num_tokens_unpadded, num_tokens_padded=num_tokens_padded, num_reqs=num_reqs, num_reqs_padded=num_reqs_padded, max_query_len=max_query_len, ubatch_slices=ubatch_slices_padded if pad_attn else ubatch_slices, for_cudagraph_capture=is_graph_capturing, num_scheduled_tokens_np=num_scheduled_tokens)
                if not is_graph_capturing:
                    for kv_cache_gid in range(len(self.kv_cache_config.kv_cache_groups)):
                        blk_table = self.input_batch.block_table[kv_cache_gid]
                        blk_table.slot_mapping.gpu.fill_(-1)
        with self.maybe_dummy_run_with_lora(self.lora_config, num_scheduled_tokens, num_sampled_tokens, remove_lora, num_active_loras=self.lora_config.max_loras if self.lora_config is not None else num_active_loras):
            assert num_tokens_padded <= self.max_num_tokens
            if self.supports_mm_inputs and (not self.model_config.is_encoder_decoder) or self.enable_prompt_embeds:
                input_ids = None
                inputs_embeds = self.inputs_embeds.gpu[:num_tokens_padded]
            else:
                input_ids = self.input_ids.gpu[:num_tokens_padded]
                inputs_embeds = None
            if self.uses_mrope:
                positions = self.mrope_positions.gpu[:, :num_tokens_padded]
            elif self.uses_xdrope_dim > 0:
                positions = self.xdrope_positions.gpu[:, :num_tokens_padded]
            else:
                positions = self.positions[:num_tokens_padded]
            update_cos_sin(positions)
            if get_pp_group().is_first_rank:
                intermediate_tensors = None
            else:
                intermediate_tokens = num_tokens_padded
                if enable_sp():
                    tp_size = get_tensor_model_parallel_world_size()
                    intermediate_tokens = (num_tokens_padded + tp_size - 1) // tp_size
                if self.intermediate_tensors is None:
                    max_actual_tokens = self.max_num_tokens
                    if enable_sp():
                        max_actual_tokens = (self.max_num_tokens + tp_size - 1) // tp_size
                    self.intermediate_tensors = self.model.make_empty_intermediate_tensors(batch_size=max_actual_tokens, dtype=self.dtype, device=self.device)
                intermediate_tensors = IntermediateTensors({k: v[:intermediate_tokens] for k, v in self.intermediate_tensors.items()})
            need_dummy_logits = not is_profile and lmhead_tp_enable()
            max_num_reqs_across_dp = max_num_reqs * self.uniform_decode_query_len
            dummy_indices = torch.zeros(max_num_reqs_across_dp, dtype=torch.int32)

            def dummy_compute_logits(hidden_states):
                if not need_dummy_logits:
                    return None
                return self.model.compute_logits(hidden_states[dummy_indices])

            def dummy_drafter_compute_logits(hidden_states):
                if not need_dummy_logits or self.drafter is None:
                    return
                if hasattr(self.drafter, 'model') and hasattr(self.drafter.model, 'compute_logits'):
                    return self.drafter.model.compute_logits(hidden_states[dummy_indices])
            with set_ascend_forward_context(attn_metadata, self.vllm_config, num_tokens=num_tokens_padded, num_tokens_across_dp=num_tokens_across_dp, in_profile_run=is_profile, num_actual_tokens=num_tokens_padded, aclgraph_runtime_mode=cudagraph_runtime_mode, batch_descriptor=batch_desc, model_instance=self.model, has_sinks=self._has_sinks, eplb_heat_collection_status=self.eplb_heat_collection_status if self.dynamic_eplb else False):
                outputs = self._model_forward(num_tokens_padded, input_ids, positions, intermediate_tensors, inputs_embeds)
            if self.use_aux_hidden_state_outputs:
                hidden_states, _ = outputs
            else:
                hidden_states = outputs
            dummy_compute_logits(hidden_states)
            if self.drafter and (not profile_cpp):
                self.drafter.dummy_run(num_tokens=num_tokens_padded, with_prefill=with_prefill, num_reqs=num_reqs_padded, num_tokens_across_dp=num_tokens_across_dp, aclgraph_runtime_mode=cudagraph_runtime_mode, batch_descriptor=batch_desc, dummy_compute_logits=dummy_drafter_compute_logits, in_graph_capturing=not force_attention, is_profile=is_profile)
            if is_profile and self.dynamic_eplb:
                self.eplb_updator.adaptor.clear_all_moe_loads()
            if not is_profile and self.dynamic_eplb:
                self.eplb_updator.forward_end(self.eplb_heat_collection_status)
            self._finalize_dump_data(dump=False)
            if self.use_compress and force_attention:
                self.positions.fill_(0)
                self._dsa_positions_cpu_buf.fill_(0)
            return (hidden_states, hidden_states)

    def load_model(self) -> None:
        load_model_start_time = time.perf_counter()
        logger.info('Starting to load model %s...', self.model_config.model)
        if self.ascend_config.mix_placement:

            def mock_true():
                return True
            rocm_aiter_ops.is_fusion_moe_shared_experts_enabled = mock_true
            rocm_aiter_ops.is_fused_moe_enabled = mock_true
        with DeviceMemoryProfiler() as m:
            if self.eplb_enable:

                def mock_pass(param1, param2):
                    return
                from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
                DefaultModelLoader._init_ep_weight_filter = mock_pass
            self.model: nn.Module = get_model(vllm_config=self.vllm_config)
            for name, _ in self.model.named_parameters():
                if 'sink' in name:
                    self._has_sinks = True
                    break
            if self.drafter:
                logger.info('Loading drafter model...')
                with get_tp_context(self.drafter):
                    self.drafter.load_model(self.model)
            pp_group = get_pp_group()
            should_configure_aux_hidden_states = self.use_aux_hidden_state_outputs if pp_group.world_size == 1 else self._eagle3_uses_aux_hidden_state()
            if should_configure_aux_hidden_states:
                from vllm.model_executor.models.interfaces import supports_eagle3
                if not supports_eagle3(self.model):
                    raise RuntimeError('Model does not support EAGLE3 interface but aux_hidden_state_outputs was requested')
                aux_layers = self._get_eagle3_aux_layers_from_config()
                if not aux_layers:
                    aux_layers = self.model.get_eagle3_default_aux_hidden_state_layers()
                self.model.set_aux_hidden_state_layers(aux_layers)
                if pp_group.world_size > 1:
                    inner_model = self.model
                    if hasattr(inner_model, 'get_language_model'):
                        inner_model = inner_model.get_language_model()
                    elif hasattr(inner_model, 'language_model'):
                        language_model = inner_model.language_model
                        inner_model = language_model() if callable(language_model) else language_model
                    if hasattr(inner_model, 'model'):
                        inner_model = inner_model.model
                    from vllm_ascend.patch.worker.patch_eagle3_pp_aux import patch_eagle3_pp_aux_propagation
                    if patch_eagle3_pp_aux_propagation(inner_model):
                        self.model.make_empty_intermediate_tensors = inner_model.make_empty_intermediate_tensors
            if self.lora_config:
                self.model = self.load_lora_model(self.model, self.vllm_config, self.device)
        self.model_memory_usage = m.consumed_memory
        logger.info('Loading model weights took %.4f GB', m.consumed_memory / float(2 ** 30))
        get_offloader().post_init()
        mm_config = self.model_config.multimodal_config
        self.is_multimodal_pruning_enabled = supports_multimodal_pruning(self.get_model()) and mm_config is not None and mm_config.is_multimodal_pruning_enabled()
        if self.compilation_config.cudagraph_mode.has_full_cudagraphs():
            self.update_stream: torch.npu.Stream = torch.npu.Stream()
            self.model = ACLGraphWrapper(self.model, self.vllm_config, runtime_mode=CUDAGraphMode.FULL, use_eagle=self.use_eagle, enable_enpu=self.enable_enpu)
            if self.drafter is not None:
                self.drafter.update_stream = self.update_stream
        if self.compilation_config.cudagraph_mode != CUDAGraphMode.NONE:
            self._start_dump_data()
        load_model_total_time = time.perf_counter() - load_model_start_time
        logger.info('Model runner load_model total time: %.2f seconds', load_model_total_time)

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """
        Initialize KV cache based on `kv_cache_config`.
        Args:
            kv_cache_config: Configuration for the KV cache, including the KV
            cache size of each layer
        """
        kv_cache_config = deepcopy(kv_cache_config)
        self.kv_cache_config = kv_cache_config
        self._mamba_bufs = None
        self._mamba_copy_bufs = None
        self.may_add_encoder_only_layers_to_kv_cache_config()
        apply_layerwise_kv_cache_plan(kv_cache_config, self.vllm_config)
        self.maybe_add_kv_sharing_layers_to_kv_cache_groups(kv_cache_config)
        self.initialize_attn_backend(kv_cache_config)
        self.use_hybrid_blocks = len(self.attn_groups) > 1
        self.need_accepted_tokens = any([isinstance(attn_group[0].kv_cache_spec, MambaSpec) for attn_group in self.attn_groups])
        self.may_reinitialize_input_batch(kv_cache_config)
        if self.sparse_kv_offload_enabled:
            self.sparse_kv_offload_manager = init_sparse_kv_offload_manager(self.vllm_config, kv_cache_config, self.sparse_kv_offload_config)
        kv_caches = self.initialize_kv_cache_tensors(kv_cache_config)
        if self.speculative_config and self.drafter is not None and (self.speculative_config.use_eagle() or self.speculative_config.uses_draft_model()):
            assert isinstance(self.drafter, AscendEagleProposer | AscendDflashProposer | AscendDSparkProposer | AscendDraftModelProposer)
            block_size = self.kernel_block_sizes[0] if isinstance(self.kernel_block_sizes, list) else self.kernel_block_sizes
            self.drafter.initialize_attn_backend(kv_cache_config, block_size)
        if self.speculative_config and self.speculative_config.uses_extract_hidden_states():
            assert isinstance(self.drafter, AscendExtractHiddenStatesProposer)
            self.drafter.validate_same_kv_cache_group(kv_cache_config)
        if self.sparse_kv_offload_enabled:
            assert self.sparse_kv_offload_manager is not None
            self.sparse_kv_offload_manager.register_kv_caches(kv_caches)
        if has_kv_transfer_group():
            get_kv_transfer_group().register_kv_caches(kv_caches)
        if self.model_config.enable_return_routed_experts:
            self.init_routed_experts_capturer()

    def _check_and_update_cudagraph_mode(self, attention_backends: list[set[type[AttentionBackend]]], kv_cache_groups: list[KVCacheGroupSpec]) -> None:
        min_cg_support = AttentionCGSupport.ALWAYS
        min_cg_attn_backend = None
        for attn_backend_set, kv_cache_group in zip(attention_backends, kv_cache_groups):
            for attn_backend in attn_backend_set:
                builder_cls = attn_backend.get_builder_cls()
                cg_support = builder_cls.get_cudagraph_support(self.vllm_config, kv_cache_group.kv_cache_spec)
                if cg_support.value < min_cg_support.value:
                    min_cg_support = cg_support
                    min_cg_attn_backend = attn_backend.__name__
        with update_pass_config(self):
            cudagraph_mode = self.compilation_config.resolve_cudagraph_mode_and_sizes(min_cg_support=min_cg_support, min_cg_attn_backend=min_cg_attn_backend, uniform_decode_query_len=self.uniform_decode_query_len, use_v2_model_runner=False, tensor_parallel_size=self.parallel_config.tensor_parallel_size, kv_cache_config=self.kv_cache_config, max_num_reqs=self.max_num_reqs)
            self.cudagraph_dispatcher.initialize_cudagraph_keys(cudagraph_mode, self.uniform_decode_query_len)
        if self.speculative_config and self.drafter is not None and (self.speculative_config.use_eagle() or self.speculative_config.uses_extract_hidden_states()):
            assert isinstance(self.drafter, AscendEagleProposer | AscendDflashProposer | AscendExtractHiddenStatesProposer)
            self.drafter.initialize_cudagraph_keys(cudagraph_mode)
        capture_descs = self.cudagraph_dispatcher.get_capture_descs()
        capture_sizes = sorted({desc.num_tokens for _, descs in capture_descs for desc in descs})
        if self.use_aclgraph:
            set_graph_params(capture_sizes)
            if self.speculative_config:
                set_draft_graph_params(capture_sizes)
