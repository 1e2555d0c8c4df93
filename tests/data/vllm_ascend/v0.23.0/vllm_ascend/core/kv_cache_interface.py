# excerpt of vllm-ascend v0.23.0: vllm_ascend/core/kv_cache_interface.py (signatures)
from dataclasses import dataclass, field
import torch
from typing_extensions import Self
from vllm.config import VllmConfig
from vllm.utils.math_utils import cdiv
from vllm.utils.torch_utils import get_dtype_size
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowMLASpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry
from vllm_ascend.core.single_type_kv_cache_manager import CompressAttentionManager
from vllm_ascend.utils import AscendDeviceType, get_ascend_device_type

def _get_c8_k_cache_dtype() -> torch.dtype:
    ...

def _get_c8_k_scale_cache_dtype() -> torch.dtype:
    ...

@dataclass(frozen=True, kw_only=True)
class AscendMLAAttentionSpec(MLAAttentionSpec):
    scale_dim: int = 0
    scale_dtype: torch.dtype = torch.int8
    sparse_head_dim: tuple[int, ...] | None = None
    cache_sparse_sfa_c8: bool = False
    cache_sparse_li_c8: bool = False
    c8_k_cache_dtype: torch.dtype = field(default_factory=_get_c8_k_cache_dtype)
    c8_k_scale_cache_dtype: torch.dtype = field(default_factory=_get_c8_k_scale_cache_dtype)
    sfa_dcp_replicated_indexer_size: int = 1

    @property
    def page_size_bytes(self) -> int:
        ...

    @property
    def sparse_kv_cache_ratio(self) -> tuple[float, float | None, float | None, float | None]:
        ...

    @classmethod
    def merge(cls, specs: list[Self]) -> Self:
        ...

    def max_memory_usage_bytes(self, vllm_config: VllmConfig) -> int:
        ...

@dataclass(frozen=True, kw_only=True)
class AscendSlidingWindowMLASpec(SlidingWindowMLASpec):
    cache_dtype_str: str | None = None
    alignment: int | None = None
    compress_ratio: int = 1
    model_version: str | None = None

    def __post_init__(self):
        ...

    @property
    def storage_block_size(self) -> int:
        ...

    @property
    def real_page_size_bytes(self) -> int:
        ...

    @classmethod
    def merge(cls, specs: list[Self]) -> Self:
        ...

def register_ascend_kv_cache_specs() -> None:
    ...
