"""The one place that answers "can Triton run here, and is it interpreting?".

Triton runs natively on CUDA tensors. On a machine without a GPU it runs only through its interpreter,
which must be switched on with ``TRITON_INTERPRET=1`` *before* ``triton`` is imported; the test suite's
``conftest.py`` does that. Nothing else in the package probes the environment.
"""

from __future__ import annotations

import os

import torch

__all__ = ["HAS_TRITON", "INTERPRET", "triton", "tl", "constexpr", "jit", "require_triton", "triton_runs_on"]

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton does not install
    triton = None
    tl = None
    HAS_TRITON = False


def triton_runs_on(x: torch.Tensor) -> bool:
    """True when a Triton kernel can take ``x``: a CUDA tensor, or any CPU tensor under the interpreter."""
    if not HAS_TRITON:
        return False
    if x.device.type == "cuda":
        return True
    return INTERPRET and x.device.type == "cpu"


def require_triton(x: torch.Tensor) -> None:
    """Raise a clear error when the Triton backend was forced but cannot run on ``x``."""
    if not HAS_TRITON:
        raise RuntimeError("backend='triton' needs the triton package; install it or use backend='torch'")
    if not triton_runs_on(x):
        raise RuntimeError(
            f"backend='triton' cannot run on a {x.device.type} tensor: Triton needs a CUDA tensor, or "
            "TRITON_INTERPRET=1 set before triton is imported to run on the CPU (slowly); use backend='torch'"
        )


def jit(fn=None, **options):
    """``triton.jit`` (with its options: ``do_not_specialize``, ...) when Triton is installed; otherwise the
    plain function, never launched."""
    if fn is None:
        return lambda f: jit(f, **options)
    return triton.jit(fn, **options) if HAS_TRITON else fn


def constexpr(value):
    """A module-level constant that kernels may read: the compiler reads only ``tl.constexpr`` globals (the
    interpreter reads any, so only compiling for a GPU catches a plain one). Without Triton, the value itself."""
    return tl.constexpr(value) if HAS_TRITON else value
