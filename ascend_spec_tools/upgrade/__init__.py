"""The upgrade check (``ascend-spec upgrade-check``): what a vLLM bump breaks, before making it.

A user-facing tool, like ``tools/``: it reads ``ascend_spec.compat.manifest`` (pure Python) and never imports vLLM
itself; the runtime check runs vLLM in a separate virtualenv.

``index``        which releases the package index has, and their wheels
``remote_zip``   only the needed members of a remote wheel, by HTTP range requests
``source_tree``  a directory holding ``vllm/``, and where names are bound in it
``reader``       fingerprints read from a release's sources (AST only), one per manifest item
``fetch``        source trees of the installed vLLM, a source dir, a wheel file, or a release (cached)
``report``       two releases compared item by item; Markdown and JSON
``matrix``       in which release each item drifted, over a range of releases
``runtime``      ``--run-tests``: the parity suite and acceptance gate in a cached virtualenv per release
``acceptance``   the acceptance gate: per-position acceptance, golden vs now and ours vs vLLM's
``cli``          the command line
"""
