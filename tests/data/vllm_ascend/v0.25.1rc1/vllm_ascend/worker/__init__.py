# excerpt of vllm-ascend v0.25.1rc1: vllm_ascend/worker/__init__.py (empty)
