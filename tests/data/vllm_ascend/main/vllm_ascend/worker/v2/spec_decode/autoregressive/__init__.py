# excerpt of vllm-ascend main: vllm_ascend/worker/v2/spec_decode/autoregressive/__init__.py (empty)
