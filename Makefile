# `make test` and `make demo` work from a fresh clone: they build .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: test test-unit test-isa demo docs venv sandbox-tool gpu-check clean

$(BIN)/arbor: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[dev,ray]"
	touch $(BIN)/arbor

venv: $(BIN)/arbor sandbox-tool

# The tool sandbox builds its filesystem view with bubblewrap; as root with apt it is installed here,
# elsewhere the sandbox falls back to unshare (same view, slower start: docs/rl.md).
sandbox-tool:
	@command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get install -y -qq bubblewrap >/dev/null 2>&1 || \
	    { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq bubblewrap >/dev/null 2>&1; }; }; } || \
	  echo "note: bubblewrap (bwrap) is not installed; the tool sandbox uses unshare instead"

test: venv
	$(BIN)/python -m pytest || [ $$? -eq 5 ]  # 5: no tests collected

test-unit: venv    # the in-process unit tests: no child processes, Ray, server load or benches
	$(BIN)/python -m pytest -m "not slow"

# The numerics tests again without Arbor's C kernels, then as on an AVX2-only CPU: PyTorch's
# kernels, oneDNN and MKL capped at AVX2 and the C kernels built for x86-64-v3 (those needing
# AVX-512 report themselves unavailable and their callers take the PyTorch path).
AVX2 := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ARBOR_CPU_ARCH=x86-64-v3
test-isa: venv
	ARBOR_CPU_KERNELS=0 $(BIN)/python -m pytest -m numerics
	if grep -qw avx2 /proc/cpuinfo; then $(AVX2) $(BIN)/python -m pytest -m numerics; \
	else echo "test-isa: this CPU has no AVX2; the AVX2 setting is its default run"; fi

demo: venv
	$(BIN)/arbor demo

# The CUDA paths in one run of a few minutes on one GPU (arbor/bench/gpu_check.py): engine vs transformers,
# LayerKV, the server, bf16 SFT and RL steps at Qwen3-0.6B's shape with peak memory against the memory plan.
gpu-check: venv
	$(BIN)/python -m arbor.bench.gpu_check --out runs/gpu-check

docs: venv    # the generated docs: docs/benchmarks + README results table, and docs/config.md
	$(BIN)/arbor bench render
	$(BIN)/python -m arbor.cli.reference

clean:
	rm -rf $(VENV) runs .pytest_cache
