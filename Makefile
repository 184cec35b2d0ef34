# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3

.PHONY: torch setup setup-demo test demo bench bench-kernels lint

# torch is installed only when missing; a machine that already has torch (a CUDA build, say) keeps it. Without an
# NVIDIA GPU it comes from PyTorch's CPU index where that answers (PyPI's Linux wheel is the CUDA build, several GB
# with its nvidia-* packages), else from pip's own index, in the same pip run as numpy and ninja (gactx needs both:
# one run less on a new machine). PIP_INSTALL=echo shows the command without running it.
TORCH_VERSION ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
PIP_INSTALL ?= $(PYTHON) -m pip install --quiet
torch:
	@$(PYTHON) -c "import torch" 2>/dev/null || { \
		if ! command -v nvidia-smi >/dev/null 2>&1 && $(PYTHON) -c "import urllib.request as u; \
			u.urlopen('$(TORCH_CPU_INDEX)/torch/', timeout=5)" >/dev/null 2>&1; then \
			echo "no NVIDIA GPU: torch $(TORCH_VERSION), CPU build, from $(TORCH_CPU_INDEX)"; \
			$(PIP_INSTALL) torch==$(TORCH_VERSION) --index-url $(TORCH_CPU_INDEX); \
		else \
			$(PIP_INSTALL) torch==$(TORCH_VERSION) numpy ninja; \
		fi; }

# Tests and benchmarks: gactx with its test and benchmark extras.
setup: torch
	$(PYTHON) -m pip install --quiet -e ".[test,bench]"

# The demo: gactx with the demo's models and progress bar only. gactx's C++ CPU kernels compile on first use
# (about a minute, once a machine and torch): here they compile in the background while pip installs the rest.
setup-demo: torch
	$(PYTHON) -m pip install --quiet numpy ninja
	@echo "building gactx's CPU kernels in the background (once) while pip installs the demo's packages"
	@$(PYTHON) -c "import gactx.kernels.cpu as cpu; cpu.available()" & build=$$!; \
	$(PYTHON) -m pip install --quiet -e ".[demo]"; installed=$$?; \
	wait $$build; exit $$installed

test: setup
	$(PYTHON) -m pytest -n 2 --dist worksteal -q

demo: setup-demo
	$(PYTHON) -m benchmarks.demo

# The committed CPU results (fp32: every model and method, with sweeps; bf16: three models, four methods), rewritten.
# On a GPU, `python -m benchmarks.run --max-batch --sweep --update-results`: the full-size models, both precisions.
bench: setup
	$(PYTHON) -m benchmarks.run --size small --precisions fp32 --train-steps 20 --warmup 3 --timed 5 --sweep \
		--update-results
	$(PYTHON) -m benchmarks.run --size small --precisions bf16 --models sage bert-base resnet50 \
		--methods fp L1.2 L2.2 checkpoint --train-steps 20 --warmup 3 --timed 5 --out benchmarks/results/cpu/bf16

# The compiled kernels' roofline for three GPUs (no GPU needed), then throughput on this machine's device: the
# committed results, rewritten.
bench-kernels: setup
	$(PYTHON) -m benchmarks.kernels --gpu h100 h200 a100 --update-results
	$(PYTHON) -m benchmarks.kernels --throughput --update-results

lint:
	$(PYTHON) -m pip install --quiet "ruff>=0.6"
	$(PYTHON) -m ruff check gactx tests benchmarks && $(PYTHON) -m ruff format --check gactx tests benchmarks
