# excerpt of vllm-ascend main: vllm_ascend/worker/v2/__init__.py (empty)
