"""Test set-up: Triton's interpreter on machines without a GPU, and the devices to test on.

``TRITON_INTERPRET`` is read when triton is imported, so it is set here, before anything imports gactx.
"""

import os
import sys

import torch

if not torch.cuda.is_available():
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported before tests/conftest.py could set TRITON_INTERPRET=1")
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# No time limit an example: on a shared 2-core machine a test's speed says little (speed lives in benchmarks).
settings.register_profile("gactx", deadline=None)
settings.load_profile("gactx")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One intra-op thread a worker: `pytest -n 2` on 2 cores otherwise runs 4 busy threads and
    # spends most of its time switching between them.
    torch.set_num_threads(1)

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]

# Triton runs on CPU tensors only through its interpreter, which a machine with a GPU leaves off: there the
# Triton kernel tests run on CUDA tensors, natively, and their CPU cases are skipped.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TRITON_DEVICE = "cpu" if INTERPRET else "cuda"
triton_on_cpu = pytest.mark.skipif(not INTERPRET, reason="Triton runs on CPU tensors only with TRITON_INTERPRET=1")
TRITON_DEVICES = [pytest.param("cpu", marks=triton_on_cpu), pytest.param("cuda", marks=needs_cuda)]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """Every test that takes ``device`` runs on the CPU and, where there is one, on the GPU."""
    return request.param


@pytest.fixture(params=TRITON_DEVICES)
def triton_device(request) -> str:
    """Every test that launches Triton kernels on ``triton_device`` runs under the interpreter on the CPU (where
    it is on) and natively on the GPU (where there is one)."""
    return request.param


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``slow`` (a minute or more each: the ahead-of-time GPU compiles) run first, so that the
    short ones fill in around them; with ``--dist worksteal`` (the Makefile's) an idle worker takes queued
    tests from a busy one, so the slow ones do not wait in one worker's queue."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
