# excerpt of vllm-ascend v0.25.1rc1: vllm_ascend/worker/v2/spec_decode/mtp/__init__.py (empty)
