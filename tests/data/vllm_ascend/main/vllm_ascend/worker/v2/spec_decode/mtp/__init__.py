# excerpt of vllm-ascend main: vllm_ascend/worker/v2/spec_decode/mtp/__init__.py (empty)
