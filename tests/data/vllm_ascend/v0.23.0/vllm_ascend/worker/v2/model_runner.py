# excerpt of vllm-ascend v0.23.0: vllm_ascend/worker/v2/model_runner.py (runner)
from contextlib import contextmanager
import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.worker.gpu import model_runner as vllm_model_runner
from vllm.v1.worker.gpu.buffer_utils import async_copy_to_gpu
from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor
from vllm.v1.worker.gpu.input_batch import combine_sampled_and_draft_tokens, expand_idx_mapping, prepare_pos_seq_lens, prepare_prefill_inputs
from vllm.v1.worker.gpu.model_runner import GPUModelRunner
from vllm_ascend.ascend_config import get_ascend_config
from vllm_ascend.ascend_forward_context import MoECommType, get_mc2_tokens_capacity, override_mrv2_in_profile_run, select_moe_comm_method, set_mc2_mask, set_mc2_tokens_capacity
from vllm_ascend.ops.rotary_embedding import set_cos_and_sin, update_cos_sin
from vllm_ascend.utils import set_weight_prefetch_method
from vllm_ascend.worker.v2.aclgraph_utils import ModelAclGraphManager
from vllm_ascend.worker.v2.attn_utils import build_attn_state
from vllm_ascend.worker.v2.input_batch import AscendInputBatch, AscendInputBuffers
from vllm_ascend.worker.v2.spec_decode.eagle import init_speculator
from vllm_ascend.worker.v2.spec_decode.eagle.speculator import AscendEagleSpeculator
from vllm_ascend.worker.v2.states import AscendRequestState
from vllm_ascend.worker.v2.utils import torch_cuda_wrapper

class NPUModelRunner(GPUModelRunner):

    def __init__(self, vllm_config: VllmConfig, device: torch.device):
        self.ascend_config = get_ascend_config()
        parallel_config = vllm_config.parallel_config
        if parallel_config.prefill_context_parallel_size > 1 or parallel_config.decode_context_parallel_size > 1:
            raise NotImplementedError('Context parallelism is not supported by Ascend NPU model runner v2.')
        if self.ascend_config.eplb_config.dynamic_eplb:
            raise NotImplementedError('dynamic_eplb is not supported by Ascend NPU model runner v2.')
        with torch_cuda_wrapper():
            super().__init__(vllm_config, device)
        del self.req_states
        del self.input_buffers
        del self.speculator
        self.speculator: AscendEagleSpeculator | None = None
        if self.speculative_config is not None:
            self.speculator = init_speculator(self.vllm_config, self.device)
        self.req_states: AscendRequestState = AscendRequestState(max_num_reqs=self.max_num_reqs, max_model_len=self.max_model_len, max_num_batched_tokens=self.max_num_tokens, num_speculative_steps=self.num_speculative_steps, vocab_size=self.vocab_size, device=self.device)
        self.input_buffers: AscendInputBuffers = AscendInputBuffers(max_num_reqs=self.max_num_reqs, max_num_tokens=self.max_num_tokens, device=self.device)
        self.num_computed_tokens_event = torch.npu.Event()
        self.num_computed_tokens_stream = torch.npu.Stream()
        self.num_computed_tokens_cpu = torch.empty(self.max_num_reqs, dtype=torch.int32, device='cpu', pin_memory=True)
        set_weight_prefetch_method(self.ascend_config.weight_prefetch_config)
        self.decode_query_len = self.num_speculative_steps + 1
        set_cos_and_sin(vllm_config, self.max_num_reqs, self.decode_query_len, self.dtype, self.device)
        set_mc2_tokens_capacity(vllm_config, self.max_num_reqs, self.decode_query_len)
        set_mc2_mask(vllm_config, self.device)
        if self.compilation_config.cudagraph_mode.has_full_cudagraphs():
            self.update_stream: torch.npu.Stream = torch.npu.Stream()
        self.cudagraph_and_dp_padding: tuple[int, torch.Tensor | None, int] | None = None
        self.input_batch: AscendInputBatch | None = None
