"""The one place that answers "can Triton run here, and is it interpreting?".

Triton runs natively on CUDA tensors. On a machine without a GPU it runs only through its interpreter,
which must be switched on with ``TRITON_INTERPRET=1`` *before* ``triton`` is imported; the test suite's
``conftest.py`` does that. Nothing else in the package probes the environment.
"""

from __future__ import annotations

import functools
import os
import re

import torch

__all__ = [
    "HAS_TRITON",
    "INTERPRET",
    "VERSION",
    "release",
    "triton",
    "tl",
    "constexpr",
    "jit",
    "interpreting",
    "interpreter_skips_nan",
    "launch",
    "require_triton",
    "triton_runs_on",
]

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton does not install
    triton = None
    tl = None
    HAS_TRITON = False


def release(version: str) -> tuple[int, ...]:
    """``(major, minor, patch)`` of a version string ("3.7.1", "3.8.0+git1a2b", "3.9.0.dev1")."""
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


VERSION: tuple[int, ...] = release(triton.__version__) if HAS_TRITON else ()  # the installed Triton's release


def triton_runs_on(x: torch.Tensor) -> bool:
    """True when a Triton kernel can take ``x``: a CUDA tensor, or any CPU tensor under the interpreter."""
    if not HAS_TRITON:
        return False
    if x.device.type == "cuda":
        return True
    return INTERPRET and x.device.type == "cpu"


def interpreting(x: torch.Tensor) -> bool:
    """Whether a Triton kernel given ``x`` runs under the interpreter: a CPU tensor with ``TRITON_INTERPRET=1``."""
    return INTERPRET and x.device.type == "cpu"


def require_triton(x: torch.Tensor) -> None:
    """Raise a clear error when the Triton backend was forced but cannot run on ``x``."""
    if not HAS_TRITON:
        raise RuntimeError(
            "backend='triton' needs the triton package; install it or use backend='torch' "
            "(docs/install.md#triton-errors)"
        )
    if not triton_runs_on(x):
        raise RuntimeError(
            f"backend='triton' cannot run on a {x.device.type} tensor: Triton needs a CUDA tensor, or "
            "TRITON_INTERPRET=1 set before triton is imported to run on the CPU (slowly); use backend='torch' "
            "(docs/install.md#triton-errors)"
        )
    if interpreting(x) and not interpreter_skips_nan():
        raise RuntimeError(
            f"backend='triton' on a CPU tensor: the interpreter of Triton {triton.__version__} propagates NaN "
            "through tl.minimum and tl.maximum, where compiled kernels skip it, so gactx's Triton kernels would not "
            "match their torch twins; interpret them with Triton 3.8 or later, or use backend='cpp' or 'torch' "
            "(docs/install.md#triton-versions)"
        )


@functools.cache
def interpreter_skips_nan() -> bool:
    """Whether Triton's interpreter takes ``tl.minimum`` and ``tl.maximum`` of NaN and a number to the number, as
    compiled kernels do: ``PropagateNan.NONE``, the default, is PTX's ``min.f32`` / ``max.f32``, which return the
    operand that is not NaN. The kernels rely on it: NaN stands for the masked and non-finite elements in a group's
    minimum and maximum, and for a non-finite element's code before it is clamped. The interpreters of Triton 3.5.1,
    3.6.0 and 3.7.1 (what torch 2.9 to 2.13 pin) run them as numpy's ``minimum`` and ``maximum``, which propagate
    NaN; 3.8's and 3.9's as ``fmin`` and ``fmax``. Asked of the interpreter itself, by one launch, the first time a
    kernel would be interpreted."""
    x, out = torch.tensor([float("nan")]), torch.zeros(2)
    _minimum_maximum_of_nan[(1,)](x, out)
    return out.tolist() == [1.0, 1.0]


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


@jit
def _minimum_maximum_of_nan(x_ptr, out_ptr):
    """``min(NaN, 1)`` and ``max(NaN, 1)``: both 1 where NaN is skipped (see :func:`interpreter_skips_nan`)."""
    x = tl.load(x_ptr)
    tl.store(out_ptr, tl.minimum(x, 1.0))
    tl.store(out_ptr + 1, tl.maximum(x, 1.0))


# Compiled kernels bound for a direct launch (their launcher, function and metadata), by configuration (see launch).
_BOUND: dict[tuple, tuple] = {}
# Whether launch binds kernels: off under the interpreter and before Triton 3.3 (another launch convention), and from
# the first kernel whose compiled form does not have the one it knows; set it False to take Triton's own launch.
DIRECT = HAS_TRITON and not INTERPRET and hasattr(triton, "knobs")


def launch(kernel, programs: int, *args, **meta) -> None:
    """``kernel[(programs,)](*args, **meta)``, with the compiled kernel looked up once per configuration.

    Triton's own launch binds the arguments, specializes each one, builds a cache key and checks the kernel's globals
    at every call: host time that a small tensor's kernel does not take on a GPU. The first call of a
    configuration goes through it and keeps the compiled kernel it returns; later calls pass the same arguments to
    that kernel's launcher, as Triton's own launch does (Triton 3.3 and later: every argument of the signature,
    constexprs included, and the launch hooks). A configuration is what Triton specializes on: the meta-parameters,
    each tensor's dtype and 16-byte alignment, each integer's width (and, for an integer that is specialized, whether
    it is 1 or a multiple of 16), and the current device. Under the interpreter, with a launch hook installed (a
    profiler's) or on an older Triton, every call takes Triton's own launch. The bytes are the same either way
    (``tests/kernels/test_launch.py``); the host time a call is what differs (``python -m benchmarks.gpu``, host arm).
    """
    global DIRECT
    hooks = triton.knobs.runtime if DIRECT else None
    if hooks is None or _hooked(hooks.launch_enter_hook) or _hooked(hooks.launch_exit_hook):
        kernel[(programs,)](*args, **meta)
        return
    key = (kernel, *meta.values(), *map(_kind, args), _device())
    bound = _BOUND.get(key)
    if bound is None:
        compiled = kernel[(programs,)](*args, **meta)
        try:
            names = tuple(kernel.arg_names[len(args) :])  # the meta-parameters among the signature's arguments
            if not all(name in meta for name in names):
                raise KeyError(names)
            _BOUND[key] = (compiled.run, compiled.function, compiled.packed_metadata, names)
        except (AttributeError, KeyError, TypeError):  # another convention: Triton's own launch
            DIRECT = False
        return
    run, function, packed, names = bound
    values = (*args, *(meta[name] for name in names))
    enter, leave = hooks.launch_enter_hook, hooks.launch_exit_hook  # empty: no launch metadata is read
    run(programs, 1, 1, _stream(key[-1]), function, packed, None, enter, leave, *values)


def _hooked(hook) -> bool:
    """Whether a launch hook would run: recent Triton (3.6, 3.9) holds an empty chain of hooks where none is installed
    (``knobs.HookChain``), earlier versions ``None``."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _device() -> int:
    """The device Triton launches on: the current one (as Triton's own launch takes it)."""
    return triton.runtime.driver.active.get_current_device()


def _stream(device: int) -> int:
    return triton.runtime.driver.active.get_current_stream(device)


def _kind(arg) -> tuple:
    """What Triton specializes an argument on (see :func:`launch`)."""
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if isinstance(arg, bool) or not isinstance(arg, int):
        return (type(arg),)
    return (-(1 << 31) <= arg < (1 << 31), arg == 1, arg % 16 == 0)
