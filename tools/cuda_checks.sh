#!/usr/bin/env bash
# The checks that need an NVIDIA GPU, in one run: adaptive K against no-spec and every fixed K on CUDA graphs
# (tools/bench.py on the 2-layer fixture in fp32: about 4 minutes on one H200, compiles cold), the `cuda` tests under
# strict graphs (about 5 minutes cold), then the bundled 12-layer model in bf16 with what is left of TOTAL_SECONDS
# (BUNDLED_MODEL: its folder; a bf16 copy halves what a remote machine is sent).
# Runs on the machine's own torch without installing the project: graph/ and compat/ are linked under ascend_spec/
# as the installed package lays them out. Reports go to $CHECKS_OUT (default: a fresh temporary folder).
set -u
cd "$(dirname "$0")/.."
for d in graph compat; do [ -e "ascend_spec/$d" ] || ln -s "../$d" "ascend_spec/$d"; done
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d)}" ASCEND_SPEC_CACHE_DIR="${ASCEND_SPEC_CACHE_DIR:-$(mktemp -d)}"
export ASCEND_SPEC_GRAPH_FAILURE=raise PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out="${CHECKS_OUT:-$(mktemp -d)}"
start=$SECONDS
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'
bench() {  # name, seconds, bench arguments...
    local name=$1 limit=$2; shift 2
    timeout "$limit" python3 tools/bench.py --device cuda --no-account --out "/tmp/bench-$name" "$@"
    echo "bench $name: exit $? after $((SECONDS - start)) s"
    cp "/tmp/bench-$name/results.md" "$out/$name.md" 2>/dev/null
    cp "/tmp/bench-$name/results.json" "$out/$name.json" 2>/dev/null
}
bench fixture "${FIXTURE_TIMEOUT:-300}" --model ascend_spec/models/tiny-dsv3-2l-mtp --batches 1 4 8 --ks 1 2 3 \
    --max-tokens 128 --rounds 2
timeout "${CUDA_TEST_TIMEOUT:-300}" python3 -m pytest -q -rs -m cuda -p no:cacheprovider --durations=10 \
    tests/test_graph_mode.py tests/test_mla_kernels.py tests/test_kv_layouts.py
echo "cuda tests: exit $? after $((SECONDS - start)) s"
left=$(( ${TOTAL_SECONDS:-840} - (SECONDS - start) ))
if [ "$left" -gt 90 ]; then
    bench bundled-bf16 "$left" --model "${BUNDLED_MODEL:-ascend_spec/models/tiny-dsv3-mtp}" --dtype bfloat16 \
        --batches 1 4 --ks 2 --max-tokens 128 --rounds 1
fi
