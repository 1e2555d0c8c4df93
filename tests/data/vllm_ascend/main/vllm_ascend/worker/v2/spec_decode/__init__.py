# excerpt of vllm-ascend main: vllm_ascend/worker/v2/spec_decode/__init__.py (signatures)
import torch
from vllm.config import VllmConfig

def init_speculator(vllm_config: VllmConfig, device: torch.device):
    ...
