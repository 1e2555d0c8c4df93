"""ascend-spec's tools, apart from the runtime every vLLM worker imports: the upgrade check and acceptance gate
(``upgrade``), graph-fault injection and tiny checkpoints for tests and benchmarks, and the ``ascend-spec`` command.

Installed beside ``ascend_spec``; nothing in ``ascend_spec`` imports this package (``tests/test_layers.py``).
"""
