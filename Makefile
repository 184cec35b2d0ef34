# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3

.PHONY: setup test demo bench-kernels lint

# torch is installed only when missing: a CPU-only machine takes torch 2.13.0 (its CPU build), and a
# machine that already has torch (a CUDA build, say) keeps it.
setup:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install --quiet torch==2.13.0
	$(PYTHON) -m pip install --quiet -e ".[test,bench]"

test: setup
	$(PYTHON) -m pytest -n 2 -q

demo: setup
	$(PYTHON) -m benchmarks.demo

bench-kernels: setup
	$(PYTHON) -m benchmarks.kernels

lint:
	ruff check gactx tests benchmarks && ruff format --check gactx tests benchmarks
