"""Pure-torch graph definitions of the DeepSeek-V3 target model and its MTP layer.

Installed as ``ascend_spec.graph``. Nothing here imports vLLM; every function takes fixed-shape
tensors and never branches in Python on tensor values, so it compiles with ``fullgraph=True``.
"""
