# excerpt of vllm-ascend v0.23.0: vllm_ascend/platform.py (class-attrs)
from __future__ import annotations
import math
import os
from importlib import import_module, util
from typing import TYPE_CHECKING, Any
from uuid import uuid4
import torch
import vllm.envs as envs_vllm
from vllm.logger import logger
from vllm.platforms import Platform, PlatformEnum
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm_ascend.ascend_config import init_ascend_config
from vllm_ascend.utils import ASCEND_QUANTIZATION_METHOD, COMPILATION_PASS_KEY, COMPRESSED_TENSORS_METHOD, FP8_METHOD, AscendDeviceType, bootstrap_custom_op_env, check_kv_extra_config, enable_sfa_dcp_replicated_indexer, flashcomm2_enable, get_ascend_device_type, is_moe_model, model_uses_sfa_sparse, refresh_block_size, update_cudagraph_capture_sizes, is_310p, enable_sp

class NPUPlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name: str = 'npu'
    device_type: str = 'npu'
    simple_compile_backend: str = 'eager'
    ray_device_key: str = 'NPU'
    device_control_env_var: str = 'ASCEND_RT_VISIBLE_DEVICES'
    ray_noset_device_env_vars: list[str] = ['RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES']
    dispatch_key: str = 'PrivateUse1'
    supported_quantization: list[str] = [ASCEND_QUANTIZATION_METHOD, COMPRESSED_TENSORS_METHOD, FP8_METHOD, 'deepseek_v4_fp8']
