# excerpt of vllm-ascend v0.24.0rc1: vllm_ascend/worker/v2/__init__.py (empty)
