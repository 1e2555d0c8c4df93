# excerpt of vllm-ascend v0.23.0: vllm_ascend/__init__.py (empty)
