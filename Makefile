# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3

.PHONY: torch setup setup-demo test demo bench bench-kernels lint

# torch is installed only when missing; a machine that already has torch (a CUDA build, say) keeps it. Which build:
# TORCH_BUILD=cpu (PyTorch's CPU index) or TORCH_BUILD=cuda (pip's own index, whose Linux wheel is the CUDA build,
# several GB with its nvidia-* packages); by default (auto) the CPU build where no NVIDIA GPU is seen (nvidia-smi) and
# PyTorch's CPU index answers, else pip's own (with numpy and ninja in the same pip run: gactx needs both, and a run
# less matters there), which may serve a local or mirrored wheel. Before pip starts, gactx/_torch_build.py says what
# pip will take (asked with --dry-run): the build, its source and its size. PIP_INSTALL=echo shows the command
# without running it.
TORCH_VERSION ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_BUILD ?= auto
PIP_INSTALL ?= $(PYTHON) -m pip install --quiet
torch:
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
		echo "torch $$($(PYTHON) -c 'import torch; print(torch.__version__)') is installed: kept"; \
	else \
		build=$(TORCH_BUILD); why="TORCH_BUILD=$(TORCH_BUILD)"; \
		if [ "$$build" = auto ]; then \
			if command -v nvidia-smi >/dev/null 2>&1; then build=cuda; why="an NVIDIA GPU is present"; \
			elif $(PYTHON) -c "import urllib.request as u; u.urlopen('$(TORCH_CPU_INDEX)/torch/', timeout=5)" \
				>/dev/null 2>&1; then build=cpu; why="no NVIDIA GPU"; \
			else build=cuda; why="no NVIDIA GPU, but $(TORCH_CPU_INDEX) did not answer"; fi; \
		fi; \
		echo "torch: $$why"; \
		if [ "$$build" = cpu ]; then \
			$(PYTHON) gactx/_torch_build.py torch==$(TORCH_VERSION) --index-url $(TORCH_CPU_INDEX) 2>/dev/null || \
			echo "installing torch $(TORCH_VERSION), CPU build, from $(TORCH_CPU_INDEX): about 190 MB."\
				"TORCH_BUILD=cuda installs the CUDA build instead."; \
			$(PIP_INSTALL) torch==$(TORCH_VERSION) --index-url $(TORCH_CPU_INDEX); \
		elif [ "$$build" = cuda ]; then \
			$(PYTHON) gactx/_torch_build.py torch==$(TORCH_VERSION) 2>/dev/null || \
			echo "installing torch $(TORCH_VERSION) from pip's index: on Linux PyPI's CUDA build, about 5 GB with"\
				"its nvidia-* packages; this takes minutes. TORCH_BUILD=cpu installs the CPU build (190 MB) instead."; \
			$(PIP_INSTALL) torch==$(TORCH_VERSION) numpy ninja; \
		else \
			echo "TORCH_BUILD=$$build is not one of auto, cpu, cuda" >&2; exit 2; \
		fi; \
	fi

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
