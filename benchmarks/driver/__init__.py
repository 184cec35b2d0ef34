"""A recording CUDA driver (``recording.c``): a ``libcuda.so.1`` whose entry points succeed and run nothing, built with
the machine's C compiler against the ``cuda.h`` of the triton wheel. With it Triton's launcher and gactx's launches from
C++ (``gactx.kernels.native``) run on a machine with no GPU: a launch costs its host work alone, and where
``$GACTX_RECORDING_DRIVER_LOG`` names a file, each module load, function lookup and launch is appended to it (a
launch with the bytes of each parameter, their sizes set by ``recording_expect``). The launch tests
(``tests/kernels/test_launch_record.py``) and ``python -m benchmarks.host``'s native method use it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

__all__ = ["build", "buildable", "cuda_h"]

HERE = Path(__file__).parent


def cuda_h() -> Path | None:
    """The ``cuda.h`` of the installed triton wheel, or ``None``."""
    try:
        import triton
    except ImportError:
        return None
    found = Path(triton.__file__).parent / "backends" / "nvidia" / "include" / "cuda.h"
    return found if found.exists() else None


def buildable() -> bool:
    """Whether :func:`build` can build the driver here (a C compiler and the triton wheel's ``cuda.h``)."""
    return (shutil.which("cc") or shutil.which("gcc")) is not None and cuda_h() is not None


def build(folder: Path) -> Path | None:
    """``folder/libcuda.so.1`` built (and ``libcuda.so``, which Triton 3.5's launcher links), or ``None`` without a C
    compiler or the triton wheel's ``cuda.h``."""
    if not buildable():
        return None
    compiler, header = shutil.which("cc") or shutil.which("gcc"), cuda_h()
    folder.mkdir(parents=True, exist_ok=True)
    library = folder / "libcuda.so.1"
    sources = [str(HERE / "recording.c"), str(HERE / "tensor_maps.c")]
    cmd = [compiler, "-shared", "-fPIC", "-O1", f"-I{header.parent}", *sources, "-o", str(library)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    link = folder / "libcuda.so"
    if not link.exists():
        link.symlink_to("libcuda.so.1")
    return library
