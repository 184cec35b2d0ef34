"""Launches of Triton's compiled kernels from C++, through the CUDA driver API (``csrc/driver.cpp``, in the CPU
kernels' extension): a kernel's cubin is loaded once, and a launch packs its parameters in C++ and calls
``cuLaunchKernel`` with the grid, block, shared memory and stream that Triton's own launcher passes
(``tests/kernels/test_launch_record.py`` holds the two to the same bytes through a recording driver).

The driver is a library opened when the program runs (``libcuda.so.1``, as Triton and torch find it): the extension
builds on a machine with no GPU, against the ``cuda.h`` of the triton wheel.

Replayed saves of CUDA tensors take these launches (:func:`quantize_packer`, :func:`bins_packer`): the uniform codes'
quantize and FewBit's bins, each with its decoding, compiled by Triton for the device once a configuration and size,
and packed and unpacked by one C++ call each (``csrc/saved.cpp``), in the eager lane (``gactx/controller/lane.py``).
What they cannot serve (no driver, an unaligned tensor, a kernel asking for scratch memory) goes through Triton's
launcher as before; :func:`why_not` says why, and ``Controller.report()`` which path served the saves.

Under :func:`recording` the same packers serve CPU tensors, their kernels compiled for sm_90 and launched through the
library it names (the recording driver of the tests): the native path's host work, measured on a machine with no
GPU. What such a save stores is not computed (the driver runs nothing): gradients then mean nothing.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from gactx.kernels import cpu

__all__ = [
    "ENABLED", "available", "open_driver", "load", "kinds", "launch", "unavailable", "why_not", "quantize_packer",
    "bins_packer", "recording",
]  # fmt: skip

ENABLED = True  # False: every CUDA save through Triton's launcher (a comparison's baseline)
_opened: str | None = None  # the library the driver's entry points came from
_recording: str | None = None  # recording(): CPU tensors served, through this library
_problem: dict[str, str] = {}  # library -> why it cannot serve ("" where it does)

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


def unavailable() -> str:
    """Why no save can take native launches in this process ("" where they can, a driver aside): they are switched
    off, Triton is missing or interpreted, or the extension was built without the triton wheel's ``cuda.h``."""
    if not ENABLED:
        return "native.ENABLED is False"
    from gactx.kernels import _triton

    if not _triton.HAS_TRITON:
        return "no Triton"
    if _triton.INTERPRET:
        return "TRITON_INTERPRET=1: Triton's kernels are interpreted, not compiled"
    if not available():
        return "the C++ extension was built without the triton wheel's cuda.h"
    return ""


def why_not(like: torch.Tensor) -> str:
    """Why replayed saves like ``like`` are not packed by native launches ("" where they are)."""
    kind = like.device.type  # (a fake tensor's device, while a graph is traced)
    if kind == "cpu" and _recording is None:
        return "a CPU tensor (the C++ kernels serve it)"
    if kind not in ("cpu", "cuda"):
        return f"a {kind} tensor"
    library = _recording if kind == "cpu" else "libcuda.so.1"
    return unavailable() or _driver_problem(library) or _stream_problem(like.device)


@functools.cache
def _stream_problem(device: torch.device) -> str:
    """Whether C++ reads torch's current stream on ``device`` as torch's Python does ("" where it does)."""
    if device.type != "cuda":
        return ""
    try:
        ours = cpu.built.current_stream(device)
    except RuntimeError as e:
        return f"torch's current stream cannot be read from C++ ({e})"
    theirs = torch.cuda.current_stream(device).cuda_stream
    return "" if ours == theirs else f"C++ reads the current stream as {ours:#x}, torch as {theirs:#x}"


def _driver_problem(library: str) -> str:
    global _opened
    if library not in _problem:
        if _opened is not None and _opened != library:
            _problem[library] = f"the driver's entry points came from {_opened}"
        else:
            try:
                open_driver(library)
                _opened, _problem[library] = library, ""
            except RuntimeError as e:
                _problem[library] = str(e)
    return _problem[library]


@contextlib.contextmanager
def recording(library: str) -> Iterator[None]:
    """Replayed saves of CPU tensors packed by native launches through ``library`` (a recording driver's
    ``libcuda.so.1``) while the block runs: see the module docstring. Packers made inside keep serving after it."""
    global _recording
    before, _recording = _recording, library
    try:
        yield
    finally:
        _recording = before


def _target(like: torch.Tensor):
    from triton.backends.compiler import GPUTarget

    if like.device.type == "cpu":
        return GPUTarget("cuda", 90, 32)  # recording(): what an H100 compiles
    major, minor = torch.cuda.get_device_capability(like.device)
    return GPUTarget("cuda", major * 10 + minor, 32)


@functools.cache
def _kernel(family: str, key: tuple, device: torch.device, target) -> tuple[int, int, int, int]:
    """``(function, threads, shared, scratch)`` of the spec ``family`` and ``key`` give (:func:`_spec`), compiled for
    ``target`` (Triton's cache keeps the cubin) and loaded once for ``device``."""
    import triton

    from gactx.kernels import aot

    spec = _spec(family, *key)
    kernel = triton.compile(aot.ast_source(spec), target=target, options=dict(spec.options))
    md = kernel.metadata
    scratch = kinds(spec.signature, md).count("p") - sum(t.startswith("*") for t in spec.signature.values())
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        function = load(kernel)
    return function, md.num_warps * 32, md.shared, scratch


def _spec(family: str, dtype: torch.dtype, wide: bool, meta: tuple):
    """The spec of one launch: the kernel of ``family``, pointers of ``dtype``, ``n`` int64 where ``wide``."""
    from gactx.kernels import specs, tables
    from gactx.kernels.schemes.uniform import dequantize, quantize

    name = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    n = "i64" if wide else "i32"
    if family == "advance_seed":
        return specs.KernelSpec("advance_seed", {}, quantize._advance_seed_kernel, {"seed_ptr": "*i64"}, {},
                                {"num_warps": 1}, 1, 16.0, True, "")  # fmt: skip
    if family in ("quantize", "quantize_from_memory"):
        seed = "*i64" if family == "quantize_from_memory" else "i64"
        kernel, ints = quantize._quantize_kernel, {"n": n, "seed": seed, "full": "i32"}
        pointers = {"x_ptr": specs.POINTER[name], "codes_ptr": "*u8", "meta_ptr": "*fp32"}
    elif family == "dequantize":
        kernel, ints = dequantize._dequantize_kernel, {"n": n, "full": "i32"}
        pointers = {"codes_ptr": "*u8", "meta_ptr": "*fp32", "out_ptr": specs.POINTER[name]}
    elif family == "encode_bins":
        kernel, ints = tables._encode_bins_kernel, {"n": n, "full": "i32"}
        pointers = {"x_ptr": specs.POINTER[name], "edges_ptr": specs.POINTER[name], "out_ptr": "*u8"}
    else:
        width = dtype.itemsize * 8
        kernel, ints = tables._decode_table_kernel, {"n": n, "full": "i32"}
        pointers = {"packed_ptr": "*u8", "table_ptr": f"*i{width}", "out_ptr": f"*i{width}"}
    return specs.spec(family, {}, kernel, pointers, ints, dict(meta), elements=0, bytes_per_element=0.0, exact=True,
                      wide="")  # fmt: skip


def _packable(like: torch.Tensor, n: int) -> bool:
    return like.dtype in (torch.float32, torch.float16, torch.bfloat16) and n > 0 and not why_not(like)


def quantize_packer(like: torch.Tensor, bits: int, group_size: int, stochastic: bool, n: int | None = None):
    """The packer of replayed saves like ``like`` (its size, dtype and device; ``n`` elements where given) stored as
    the uniform scheme's codes by native launches (``csrc/saved.h``, ``Launches``), or ``None`` where they cannot serve
    (:func:`why_not`). A compiled graph's save registers one (``cpu.register_saved``): its ``like`` is the fake tensor
    being traced, of which only the dtype and device are read."""
    n = like.numel() if n is None else n
    if bits not in (1, 2, 4, 8) or not _packable(like, n):
        return None
    from gactx.kernels.schemes.uniform.dequantize import dequantize_launch
    from gactx.kernels.schemes.uniform.quantize import quantize_launch

    wide = n >= 2**31
    q_programs, q_full, q_meta = quantize_launch(n, like.dtype, bits, group_size, stochastic)
    d_programs, d_full, d_meta = dequantize_launch(n, like.dtype, bits, group_size)
    groups = -(-n // group_size)
    code_bytes = groups * group_size * bits // 8
    offset = -(-code_bytes // 16) * 16  # the groups' (lo, step), 16-byte aligned as the kernels were compiled
    try:
        target = _target(like)
        encode = _kernel("quantize", (like.dtype, wide, tuple(q_meta.items())), like.device, target)
        decode = _kernel("dequantize", (like.dtype, wide, tuple(d_meta.items())), like.device, target)
    except (RuntimeError, ValueError) as e:  # a kernel the launches cannot pass (scratch memory), a failed load
        _problem[f"quantize:{bits}:{group_size}"] = str(e)
        return None
    return cpu.built.Packer.launched(
        bits, group_size, like.dtype, like.device, n, encode, decode, (q_programs, q_full), (d_programs, d_full),
        code_bytes, offset, offset + groups * 8, None, None,
    )  # fmt: skip


def graph_packer(like: torch.Tensor, bits: int, group_size: int, stochastic: bool, n: int, salt: int):
    """:func:`quantize_packer` for a compiled graph's save of ``n`` elements (``like``: the fake tensor traced; its
    dtype and device read), and where it is stochastic, the kernels that draw its seed on the device when a CUDA graph
    captures it (``Launches``' ``encode_from_memory`` and ``advance``): its seed then starts from ``salt`` and advances
    at every replay. ``None`` where native launches cannot serve."""
    packer = quantize_packer(like, bits, group_size, stochastic, n)
    if packer is None or not stochastic:
        return packer
    from gactx.kernels.schemes.uniform.quantize import quantize_launch

    meta = quantize_launch(n, like.dtype, bits, group_size, stochastic)[2] | {"SEED_IN_MEMORY": True}
    try:
        target = _target(like)
        from_memory = _kernel(
            "quantize_from_memory", (like.dtype, n >= 2**31, tuple(meta.items())), like.device, target
        )
        advance = _kernel("advance_seed", (like.dtype, False, ()), like.device, target)
    except (RuntimeError, ValueError) as e:
        _problem[f"device seed:{bits}:{group_size}"] = str(e)
        return None
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():  # a real tensor, not one of the trace
        seed = torch.tensor((salt * 0x9E3779B97F4A7C15 + 1) & ((1 << 62) - 1), dtype=torch.int64, device=like.device)
    return cpu.built.Packer.with_device_seed(packer, from_memory, advance, seed)


def bins_packer(like: torch.Tensor, edges: torch.Tensor, bits: int, table: torch.Tensor):
    """The packer of replayed saves like ``like`` stored as FewBit's bins among ``edges`` (decoded as ``table``) by
    native launches, or ``None`` where they cannot serve."""
    if bits not in (2, 4, 8) or not _packable(like, like.numel()) or table.dtype != like.dtype:
        return None
    from gactx.kernels.tables import decode_table_launch, encode_bins_launch

    n, wide = like.numel(), like.numel() >= 2**31
    edges = edges.to(like.dtype).contiguous()
    e_programs, e_full, e_meta = encode_bins_launch(n, bits, edges.numel(), like.dtype)
    d_programs, d_full, d_meta = decode_table_launch(n, bits)
    code_bytes = -(-n // (8 // bits))
    try:
        target = _target(like)
        encode = _kernel("encode_bins", (like.dtype, wide, tuple(e_meta.items())), like.device, target)
        decode = _kernel("decode_table", (like.dtype, wide, tuple(d_meta.items())), like.device, target)
    except (RuntimeError, ValueError) as e:
        _problem[f"bins:{bits}"] = str(e)
        return None
    return cpu.built.Packer.launched(
        bits, 0, like.dtype, like.device, n, encode, decode, (e_programs, e_full), (d_programs, d_full), code_bytes,
        code_bytes, code_bytes, edges, table.contiguous(),
    )  # fmt: skip
