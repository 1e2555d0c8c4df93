# excerpt of vllm-ascend v0.23.0: vllm_ascend/worker/v2/__init__.py (empty)
