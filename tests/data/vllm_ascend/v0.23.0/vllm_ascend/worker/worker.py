# excerpt of vllm-ascend v0.23.0: vllm_ascend/worker/worker.py (signatures)
import copy
import gc
import logging
from types import NoneType
import torch
import torch.nn as nn
import torch_npu
from torch_npu.op_plugin.atb._atb_ops import _register_atb_extensions
from torch_npu.profiler import dynamic_profile as dp
from vllm.config import CUDAGraphMode, VllmConfig, set_current_vllm_config
from vllm.distributed import ensure_model_parallel_initialized, get_pcp_group, init_distributed_environment
from vllm.distributed.ec_transfer import ensure_ec_transfer_initialized
from vllm.distributed.kv_transfer import ensure_kv_transfer_initialized, ensure_kv_transfer_shutdown, get_kv_transfer_group, has_kv_transfer_group
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata
from vllm.distributed.parallel_state import Handle, get_pp_group, get_tp_group
from vllm.logger import logger
from vllm.lora.request import LoRARequest
from vllm.platforms import current_platform
from vllm.sequence import IntermediateTensors
from vllm.tasks import SupportedTask
from vllm.utils.mem_constants import GiB_bytes
from vllm.utils.mem_utils import MemorySnapshot, format_gib, memory_profiling
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, AsyncModelRunnerOutput, DraftTokenIds, ModelRunnerOutput
from vllm.v1.utils import report_usage_stats
from vllm.v1.worker.gpu_worker import AsyncIntermediateTensors
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase
from vllm.v1.worker.workspace import init_workspace_manager
import vllm_ascend.envs as envs_ascend
from vllm_ascend.ascend_config import get_ascend_config, init_ascend_config
from vllm_ascend.batch_invariant import init_batch_invariance
from vllm_ascend.cpu_binding import bind_cpus
from vllm_ascend.device_allocator.camem import CaMemAllocator
from vllm_ascend.device_allocator.sleep_mem_optimized import SleepWakeupManager
from vllm_ascend.distributed.parallel_state import init_ascend_model_parallel
from vllm_ascend.ops.triton.triton_utils import init_device_properties_triton
from vllm_ascend.profiler.torch_npu_profiler import TorchNPUProfilerWrapper
from vllm_ascend.utils import AscendDeviceType, check_ascend_device_type, enable_sp, get_ascend_device_type, register_ascend_customop, setup_ascend_local_comm_res, vllm_version_is
from vllm_ascend.worker.model_runner_v1 import NPUModelRunner
from torch._dynamo.variables import TorchInGraphFunctionVariable
from vllm.utils.torch_utils import set_random_seed

class NPUWorker(WorkerBase):

    def __init__(self, vllm_config: VllmConfig, local_rank: int, rank: int, distributed_init_method: str, is_driver_worker: bool=False, **kwargs):
        ...

    def uninstall_static_kernel(self):
        ...

    def sleep(self, level: int=1) -> None:
        ...

    def wake_up(self, tags: list[str] | None=None) -> None:
        ...

    def _check_weight_transfer_engine(self) -> None:
        ...

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        ...

    def _check_nz_disabled(self) -> None:
        ...

    def start_weight_update(self, is_checkpoint_format: bool=True) -> None:
        ...

    def update_weights(self, update_info: dict) -> None:
        ...

    def finish_weight_update(self) -> None:
        ...

    def shutdown(self) -> None:
        ...

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        ...

    def _init_device(self):
        ...

    def init_device(self):
        ...

    @torch.inference_mode()
    def determine_available_memory(self) -> int:
        ...

    def log_memory_stats(self) -> None:
        ...

    def execute_model(self, scheduler_output: 'SchedulerOutput') -> ModelRunnerOutput | AsyncModelRunnerOutput | None:
        ...

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: 'GrammarOutput') -> ModelRunnerOutput | AsyncModelRunnerOutput:
        ...

    def load_model(self) -> None:
        ...

    def compile_or_warm_up_model(self) -> CompilationTimes:
        ...

    def _warm_up_atb(self):
        ...

    def get_model(self) -> nn.Module:
        ...

    @torch.inference_mode()
    def profile_prefill_latency(self, num_tokens: int) -> float:
        ...

    def get_kv_connector_handshake_metadata(self) -> dict[tuple[int, ...], KVConnectorHandshakeMetadata] | None:
        ...

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        ...

    def update_max_model_len(self, max_model_len: int) -> None:
        ...

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        ...

    def profile(self, is_start: bool=True, profile_prefix: str | None=None):
        ...

    def add_lora(self, lora_request: LoRARequest) -> bool:
        ...

    def remove_lora(self, lora_id: int) -> bool:
        ...

    def list_loras(self) -> set[int]:
        ...

    def pin_lora(self, lora_id: int) -> bool:
        ...

    def reset_encoder_cache(self) -> None:
        ...

    def execute_dummy_batch(self) -> None:
        ...

    def _init_worker_distributed_environment(self) -> None:
        ...

    def get_supported_pooling_tasks(self):
        ...

    def get_supported_tasks(self) -> 'tuple[SupportedTask, ...]':
        ...

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        ...

    def check_health(self) -> None:
        ...

def parse_text_output(output) -> None:
    ...
