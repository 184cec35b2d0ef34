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


def repair_the_interpreters_minimum_and_maximum() -> bool:
    """Give Triton's interpreter the ``tl.minimum`` and ``tl.maximum`` of compiled kernels where it lacks them; True
    where it did.

    The one place where the suite corrects Triton rather than gactx. Compiled kernels skip NaN (``PropagateNan.NONE``,
    the default, is PTX's ``min.f32`` / ``max.f32`` under every supported Triton: ``aot.py`` checks the PTX), and
    gactx's kernels rely on it (``_triton.interpreter_skips_nan``). The interpreters of Triton 3.5.1, 3.6.0 and 3.7.1
    (what torch 2.9 to 2.13 pin) run them as numpy's ``minimum`` and ``maximum``, which propagate NaN: there every
    group with a masked or non-finite element would differ from its torch twin, where the compiled kernel does not.
    Triton 3.8's and 3.9's interpreters run them as ``fmin`` and ``fmax`` (triton-lang/triton#10333), as this does;
    gactx itself refuses such an interpreter (``_triton.require_triton``)."""
    from gactx.kernels import _triton

    if not INTERPRET or not _triton.HAS_TRITON or _triton.interpreter_skips_nan():
        return False
    import numpy as np
    from triton.runtime.interpreter import InterpreterBuilder

    InterpreterBuilder.create_minnumf = lambda self, lhs, rhs: self.binary_op(lhs, rhs, np.fmin)
    InterpreterBuilder.create_maxnumf = lambda self, lhs, rhs: self.binary_op(lhs, rhs, np.fmax)
    _triton.interpreter_skips_nan.cache_clear()
    if not _triton.interpreter_skips_nan():
        raise RuntimeError(f"Triton {_triton.triton.__version__}'s interpreter: the repair of tl.minimum did not take")
    return True


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
INTERPRETER_REPAIRED = repair_the_interpreters_minimum_and_maximum()
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


def pytest_report_header() -> list[str]:
    if not INTERPRETER_REPAIRED:
        return []
    import triton

    return [f"triton {triton.__version__}: its interpreter's tl.minimum and tl.maximum repaired to skip NaN (conftest)"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``slow`` (a minute or more each: the ahead-of-time GPU compiles) run first, so that the
    short ones fill in around them; with ``--dist worksteal`` (the Makefile's) an idle worker takes queued
    tests from a busy one, so the slow ones do not wait in one worker's queue."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
