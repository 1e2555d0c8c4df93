# excerpt of vllm-ascend v0.23.0: vllm_ascend/worker/v2/spec_decode/__init__.py (verbatim)
