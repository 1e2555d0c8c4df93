#!/usr/bin/env bash
# The checks that need an NVIDIA GPU, in one run (a few minutes on one H100): the `cuda` tests under strict graphs,
# then tools/probe_k_switch.py (what a change of K costs on CUDA graphs; steps under sync debug mode "error").
# Runs on the machine's own torch without installing the project: graph/ and compat/ are linked under ascend_spec/
# as the installed package lays them out.
set -u
cd "$(dirname "$0")/.."
for d in graph compat; do [ -e "ascend_spec/$d" ] || ln -s "../$d" "ascend_spec/$d"; done
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d)}" ASCEND_SPEC_CACHE_DIR="${ASCEND_SPEC_CACHE_DIR:-$(mktemp -d)}"
export ASCEND_SPEC_GRAPH_FAILURE=raise PYTHONUNBUFFERED=1
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'
timeout "${CUDA_TEST_TIMEOUT:-330}" python3 -m pytest -q -rs -m cuda -p no:cacheprovider --durations=10 \
    tests/test_graph_mode.py tests/test_mla_kernels.py tests/test_kv_layouts.py
echo "cuda tests: exit $?"
timeout "${PROBE_TIMEOUT:-240}" python3 tools/probe_k_switch.py --device cuda --batch 4 --max-tokens 64 --rounds 2
echo "probe: exit $?"
