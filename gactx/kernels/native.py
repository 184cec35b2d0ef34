"""Launches of Triton's compiled kernels from C++, through the CUDA driver API (``csrc/driver.cpp``, in the CPU
kernels' extension): a kernel's cubin is loaded once, and a launch packs its parameters in C++ and calls
``cuLaunchKernel`` with the grid, block, shared memory and stream that Triton's own launcher passes
(``tests/kernels/test_launch_record.py`` holds the two to the same bytes through a recording driver).

The driver is a library opened when the program runs (``libcuda.so.1``, as Triton and torch find it): the extension
builds on a machine with no GPU, against the ``cuda.h`` of the triton wheel. The eager and compiled paths do not use
these launches yet; they go through Triton's launcher (docs/gpu.md#launches).
"""

from __future__ import annotations

from gactx.kernels import cpu

__all__ = ["available", "open_driver", "load", "kinds", "launch"]

# A parameter's kind in the extension's packing ("p" a pointer, "i" 32 bits, "q" 64 bits, "f" float32), by Triton
# type.
_KINDS = {"i32": "i", "u32": "i", "i64": "q", "u64": "q", "fp32": "f"}


def available() -> bool:
    """Whether the extension was built with the driver's launches (a C++ compiler and the triton wheel's cuda.h)."""
    return cpu.available() and cpu.extension().driver_built()


def open_driver(library: str = "libcuda.so.1") -> None:
    """Resolve the driver's entry points from ``library``; raises ``RuntimeError`` naming what is missing."""
    if not cpu.available():
        raise RuntimeError("gactx: native launches need the C++ extension (docs/install.md)")
    problem = cpu.extension().open_driver(library)
    if problem:
        raise RuntimeError(f"gactx: the CUDA driver cannot serve native launches: {problem}")


def load(kernel) -> int:
    """The driver's handle of a Triton ``CompiledKernel``'s function, its cubin loaded."""
    return cpu.extension().load_function(kernel.asm["cubin"], kernel.metadata.name, kernel.metadata.shared)


def kinds(signature: dict, metadata) -> str:
    """The kinds of a launch's parameters: the signature's without its constexprs, then a pointer for each scratch
    buffer this Triton's kernels take (null where the kernel asks for none)."""
    try:
        out = "".join("p" if t.startswith("*") else _KINDS[t] for t in signature.values() if t != "constexpr")
    except KeyError as e:
        raise ValueError(f"gactx: native launches take pointers and {sorted(_KINDS)}, not {e.args[0]}") from None
    scratch = [getattr(metadata, f"{k}_scratch_size", None) for k in ("global", "profile")]
    if any(scratch):
        raise ValueError(f"gactx: native launches pass no scratch memory; {metadata.name} asks for {scratch} bytes")
    return out + "p" * sum(size is not None for size in scratch)


def launch(function: int, grid: tuple[int, int, int], metadata, stream: int, kinds: str, values) -> None:
    """Launch ``function`` on ``stream`` (an int, as ``torch.cuda.current_stream().cuda_stream``) with ``values`` in
    the order of ``kinds``; block and shared memory from the kernel's ``metadata``."""
    cpu.extension().launch(function, *grid, metadata.num_warps * 32, metadata.shared, stream, kinds, list(values))
