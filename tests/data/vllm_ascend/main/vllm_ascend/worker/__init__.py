# excerpt of vllm-ascend main: vllm_ascend/worker/__init__.py (empty)
