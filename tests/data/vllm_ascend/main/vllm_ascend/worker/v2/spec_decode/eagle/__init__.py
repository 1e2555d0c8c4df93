# excerpt of vllm-ascend main: vllm_ascend/worker/v2/spec_decode/eagle/__init__.py (signatures)

