# excerpt of vllm-ascend v0.24.0rc1: vllm_ascend/core/kv_cache_interface.py (signatures)
from dataclasses import dataclass
import torch
from typing_extensions import Self
from vllm.config import VllmConfig
from vllm.utils.math_utils import cdiv
from vllm.utils.torch_utils import get_dtype_size
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, SlidingWindowManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowMLASpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry
from vllm_ascend.core.single_type_kv_cache_manager import CompressAttentionManager

@dataclass(frozen=True, kw_only=True)
class AscendMLAAttentionSpec(MLAAttentionSpec):
    scale_dim: int = 0
    scale_dtype: torch.dtype = torch.int8
    cache_sparse_c8: bool = False

    @property
    def page_size_bytes(self) -> int:
        ...

    @classmethod
    def merge(cls, specs: list[Self]) -> Self:
        ...

    def max_memory_usage_bytes(self, vllm_config: VllmConfig) -> int:
        ...

@dataclass(frozen=True, kw_only=True)
class AscendSFAIndexerCacheSpec(FullAttentionSpec):
    scale_dim: int = 0
    scale_dtype: torch.dtype = torch.int8
    cache_sparse_c8: bool = False
    cache_dtype_str: str | None = None
    sfa_dcp_replicated_indexer_size: int = 1

    @property
    def page_size_bytes(self) -> int:
        ...

    @property
    def real_page_size_bytes(self) -> int:
        ...

    @classmethod
    def merge(cls, specs: list[Self]) -> Self:
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
