"""Pure-torch graph definitions of the DeepSeek-V3 target model and its MTP layer.
Installed as ``ascend_spec.graph``; nothing here imports vLLM, and every function compiles with ``fullgraph=True``.
"""
