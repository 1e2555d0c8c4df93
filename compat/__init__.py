"""vLLM adapter (installed as ``ascend_spec.compat``): the only package that imports vLLM or probes its API."""
