# excerpt of vllm-ascend v0.25.1rc1: vllm_ascend/worker/v2/spec_decode/eagle/speculator.py (signatures)
from vllm.v1.worker.gpu.spec_decode.eagle.speculator import EagleSpeculator
from vllm_ascend.worker.v2.spec_decode.autoregressive.speculator import AscendAutoRegressiveSpeculator

class AscendEagleSpeculator(AscendAutoRegressiveSpeculator, EagleSpeculator):
    pass
