# excerpt of vllm-ascend main: vllm_ascend/__init__.py (empty)
