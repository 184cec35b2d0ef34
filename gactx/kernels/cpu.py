"""CPU kernels: quantize, dequantize and table codes in C++, with no temporary larger than a group a thread.

The torch twins (each scheme folder's ``reference.py``, ``codes.py``, ``bitmask.py``) are written
for clarity and as the test oracle: about 60 full-size ATen passes a call, and temporaries several times the
tensor (a padded float32 copy, an index tensor, int32 codes), which is what an allocator's peak sees. On a CPU
the same arithmetic runs here instead: one pass to find each group's range and one to write its codes (the
normal scheme: two more, for the sums of its fractions and deviations), a group at a time per thread
(``at::parallel_for`` over groups, torch's intra-op threads). A large decoded output is advised to use
transparent huge pages before it is written (``advise_huge_pages``): a fresh buffer otherwise costs a page
fault every 4 KiB.

Same bytes as the twins: the same float32 operations in the same order, compiled without fused multiply-add
(``-ffp-contract=off``) or fast-math. ``-fno-trapping-math`` only says that no code reads the floating-point
exception flags (values are unchanged): it lets loops that select between results vectorize (the closed-form
variances of the free estimator's collecting step ran 3 to 5 times faster). With ``stochastic=True`` the noise
comes from a counter-based hash of ``(seed, element index)`` (murmur3's finalizer, twice), not from ``torch.rand``:
23 uniform bits an element, so the rounding is unbiased as before, but the codes differ from the twin's.

The C++ lives in ``csrc/`` (``common.h``, then a file a scheme and one for the ops of compiled graphs). The
extension is compiled from it on first use with ``torch.utils.cpp_extension.load`` (about a minute on 2
cores, once; cached under torch's extensions folder, rebuilt when this source changes) for the machine it
runs on (``-march=native``). Where it cannot be built (no C++ compiler, no ninja), a warning says so and the
torch twins run: slower, with their temporaries, same results.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import platform
import re
import sys
import threading
import warnings
from pathlib import Path

import torch

from gactx.kernels.format import FLOAT_DTYPES, expected_nbytes
from gactx.kernels.schemes.normal.format import SHAPES
from gactx.kernels.schemes.normal.format import factors as _normal_factors
from gactx.kernels.schemes.uniform.format import step_factor

__all__ = [
    "available", "extension", "quantize", "dequantize", "normal_quantize", "normal_dequantize", "encode_bins",
    "decode_table", "pack_bool", "pack_compare", "unpack_bool",
]  # fmt: skip


_SOURCES = Path(__file__).parent / "csrc"  # the C++: common.h, uniform codes, masks, the graph ops, the module
_SCHEMES = Path(__file__).parent / "schemes"  # a scheme folder's own C++ (schemes/normal/normal.cpp)


def _source_files() -> list[Path]:
    """Every C++ file of the extension: ``csrc``'s and the scheme folders', in a fixed order."""
    return sorted(p for p in _SOURCES.iterdir() if p.suffix in (".cpp", ".h")) + sorted(_SCHEMES.glob("*/*.cpp"))


# -mprefer-vector-width=512: where the machine has AVX-512, loops use all of it (GCC's choice for -march=native is
# 256-bit vectors there). On a Xeon with AVX-512 the stochastic rounding's hash, five 32-bit multiplies an element,
# went from 0.86 to 0.66 ns an element (quantize of 1M float32 at 4 bits: 0.90 ms to 0.69; 4096: 4.4 to 3.7 us);
# elsewhere it changes nothing. Vector width changes no value: each lane computes what the scalar code does.
_FLAGS = [
    "-O3", "-ffp-contract=off", "-fno-fast-math", "-fno-trapping-math", "-march=native", "-mprefer-vector-width=512",
    "-fopenmp",
]  # fmt: skip


def _cuda_include() -> str | None:
    """The folder of the ``cuda.h`` shipped in the triton wheel, for the launches through the CUDA driver (csrc/
    driver.cpp), found without importing triton; ``None`` without one (the extension then launches nothing)."""
    spec = importlib.util.find_spec("triton")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        folder = Path(root) / "backends" / "nvidia" / "include"
        if (folder / "cuda.h").exists():
            return str(folder)
    return None


_CUDA_INCLUDE = _cuda_include()
_FLAGS += ["-DGACTX_CUDA_H"] if _CUDA_INCLUDE is not None else []
_lock = threading.Lock()
_tried = False  # extension() has run: ``built`` is what it gave
built = None  # the compiled extension once built; the kernels below call it directly (they run for every save)


def _name() -> str:
    texts = [p.read_text() for p in _source_files()]
    key = "\n".join([*texts, *_FLAGS, str(_CUDA_INCLUDE), platform.machine(), torch.__version__])
    return "gactx_cpu_" + hashlib.sha1(key.encode()).hexdigest()[:12]


def extension():
    """The compiled extension (built on first call), or ``None`` where it cannot be built (warned once)."""
    global built, _tried
    if _tried:
        return built
    with _lock:
        if not _tried:
            built = _build()
            if built is not None:
                _register_fakes()
                _register_codegen()
            _tried = True
    return built


def _register_fakes() -> None:
    """What the ops of compiled graphs (``gactx_cpu::*_saved``, registered by the extension) return, for tracing."""

    def stored(t, nbytes):
        return t.new_empty(nbytes, dtype=torch.uint8)

    def quantize_saved(t, token):
        bits, group, _, _ = _saved[token]
        if token in _launched:  # codes, then each group's (lo, step) from a 16-byte aligned offset
            return stored(t, _launched[token])
        return stored(t, expected_nbytes(t.numel(), t.dtype, bits, group))  # codes, then each group's (lo, step)

    def dequantize_saved(buffer, token):
        _, _, shape, dtype = _saved[token]
        return buffer.new_empty(shape, dtype=FLOAT_DTYPES[dtype])

    fakes = {
        "quantize_saved": quantize_saved,
        "dequantize_saved": dequantize_saved,
        "dequantize_shaped": lambda buffer, token, shape: buffer.new_empty(shape, dtype=FLOAT_DTYPES[_saved[token][3]]),
        "pack_bool_saved": lambda t, token: stored(t, expected_nbytes(t.numel(), torch.bool, 1)),
        "unpack_bool_saved": lambda packed, shape: packed.new_empty(shape, dtype=torch.bool),
        "keep_saved": lambda t, token: stored(t, 1),
    }
    for name, fake in fakes.items():
        torch.library.register_fake(f"gactx_cpu::{name}")(fake)


# The ops of compiled graphs that Inductor's Python wrapper calls as the extension's own functions, past the dispatcher
# (_register_codegen): each takes a tensor and a token.
DIRECT_OPS = ("quantize_saved", "dequantize_saved", "pack_bool_saved", "keep_saved")
# Whether graphs compiled from here on call them so (read as each graph's code is written); False: through torch.ops.
DIRECT = True
# Whether the graph's code checks the size, strides and alignment of what these calls return, as Inductor checks an op's
# (0.5 us a call: two checks). Their results are the ones their fakes give for the token (tested through torch.ops,
# which keeps the checks); False: unchecked.
ASSERTS = False


def _register_codegen() -> bool:
    """Have Inductor's Python wrapper call :data:`DIRECT_OPS` as the extension's functions (``buf1 =
    _gactx_cpu.quantize_saved(buf0, 7)``) rather than through ``torch.ops``: the dispatcher's argument parsing and
    boxing are a large share of a small tensor's call. Through
    Inductor's registry of custom extern-kernel code (torch 2.13); where it is not there, or under the C++ wrapper,
    the calls are Inductor's own. The profiler then records no op event for these calls (the kernels' time shows
    within the graph's). Returns whether it registered."""
    try:
        from torch._inductor.codegen import custom_extern_kernel_codegen as custom
    except ImportError:
        return False
    from torch._inductor.virtualized import V

    def direct(name: str):
        def codegen(node, writeline) -> None:
            wrapper = V.graph.wrapper_code
            if not DIRECT or V.graph.cpp_wrapper or node.codegen_kwargs():
                from torch._inductor.codegen.wrapper import ExternKernelAllocLine

                writeline(ExternKernelAllocLine(wrapper, node))
                return
            # The extension as the code is loaded (built there if a cached graph is loaded first)
            wrapper.add_import_once(f"from {__name__} import extension as _gactx_extension")
            wrapper.add_import_once("_gactx_cpu = _gactx_extension()")
            writeline(f"{node.get_name()} = _gactx_cpu.{name}({', '.join(node.codegen_args())})")
            for out in getattr(node, "outputs", ()):  # the result's size asserts: see ASSERTS
                if not ASSERTS and hasattr(out, "skip_size_stride_alignment_checks"):
                    out.skip_size_stride_alignment_checks = True

        return codegen

    for name in DIRECT_OPS:
        custom.CUSTOM_EXTERN_KERNEL_CODEGEN[f"torch.ops.gactx_cpu.{name}.default"] = custom.CustomCodegen(
            python=direct(name)
        )
    return True


# What each compressed save of a compiled graph stores by, as register_saved registered it: token -> (bits, group size,
# shape where static else None, dtype's index in FLOAT_DTYPES). The ops' fake implementations read it while tracing.
_saved: dict[int, tuple[int, int, tuple[int, ...] | None, int]] = {}


_launched: dict[int, int] = {}  # token -> the bytes its native launches store (register_saved's ``launches``)


def register_saved(
    token: int, bits: int, group_size: int, stochastic: bool, salt: int, logged: bool, dtype: int, shape,
    launches=None,
) -> bool:  # fmt: skip
    """Register what the compressed save of a compiled graph under ``token`` stores by, for the ops that take its
    token alone (``gactx_cpu::quantize_saved(t, token)``, ``dequantize_saved(stored, token)``; of a dynamic shape
    ``dequantize_shaped(stored, token, shape)``): the width, group size, rounding, the noise's salt, whether it logs
    its own entry (``logged``), the dtype's index in ``FLOAT_DTYPES`` and ``shape`` (sizes, or symbolic ones), and
    ``launches``, a packer of native launches for its size (a GPU's save: ``native.quantize_packer``) whose kernels
    then store it. Whether the shape is static: then ``dequantize_saved`` decodes into it."""
    static = all(type(s) is int for s in shape)
    sizes = [int(s) for s in shape] if static else []
    built.register_saved(token, bits, group_size, stochastic, salt, logged, dtype, sizes)
    _saved[token] = (bits, group_size, tuple(sizes) if static else None, dtype)
    _launched.pop(token, None)
    if launches is not None:  # a packer of native launches (native.quantize_packer): its kernels store the save
        built.register_launches(token, launches)
        _launched[token] = launches.buffer_bytes
    return static


def drain_log() -> list[int]:
    """The events the ops of compiled graphs logged since the last call, in order: ``kind`` (0 a save ran, 2 the graph
    released it), ``token``, ``rank``, then ``rank`` sizes (none for a release). Empty where the extension is not
    built."""
    module = built
    return module.drain_log() if module is not None else []


class _NoCudaRuntimeNotice(logging.Filter):
    """Drops ``torch.utils.cpp_extension``'s notice, at its import under a CUDA build of torch on a machine with no
    GPU, that no CUDA runtime is found: gactx builds CPU kernels there, which need none."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("No CUDA runtime is found")


def _cpp_extension():
    """``torch.utils.cpp_extension``, imported without its notice that a CUDA build finds no CUDA runtime."""
    logger, quiet = logging.getLogger("torch.utils.cpp_extension"), _NoCudaRuntimeNotice()
    logger.addFilter(quiet)
    try:
        from torch.utils import cpp_extension
    finally:
        logger.removeFilter(quiet)
    return cpp_extension


def _first_build(cpp_extension, name: str) -> bool:
    """Whether the extension ``name`` is not built on this machine yet: no library in its build folder."""
    try:
        folder = Path(cpp_extension._get_build_directory(name, verbose=False))
    except Exception:  # torch moved its private helper: say it, as for a first build
        return True
    return not any((folder / f"{name}{suffix}").exists() for suffix in (".so", ".pyd"))


def _build():
    cpp_extension = _cpp_extension()
    name = _name()
    if _first_build(cpp_extension, name):  # the first step waits for the compiler: say why, once
        print(
            "gactx: building its C++ CPU kernels, once for this machine and torch (about a minute on two cores)",
            file=sys.stderr,
            flush=True,
        )
    try:
        sources = [str(p) for p in _source_files() if p.suffix == ".cpp"]
        return cpp_extension.load(
            name,
            sources,
            extra_cflags=_FLAGS,
            extra_ldflags=["-fopenmp", "-ldl"],
            extra_include_paths=[str(_SOURCES), *([_CUDA_INCLUDE] if _CUDA_INCLUDE else [])],
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, a failed build: the torch path, said once
        from gactx.config import _caller_level

        warnings.warn(
            f"gactx: the C++ CPU kernels could not be built ({type(e).__name__}: {_cause(e)}); "
            "falling back to the torch kernels (same results, slower, with temporaries the size of the tensor); "
            "see docs/install.md#the-c-kernels-did-not-build",
            RuntimeWarning,
            stacklevel=_caller_level(),
        )
        return None


def _cause(e: Exception) -> str:
    """What a failed build says went wrong: the compiler's error lines where there are some (a build log begins
    with its command lines, hundreds of characters of flags), else the end of the message."""
    text = str(e).strip()
    errors = [
        line.strip() for line in text.splitlines()
        if re.search(r"\berror\b", line, re.IGNORECASE) and not line.startswith("Error building extension")
    ]  # fmt: skip
    return ("; ".join(dict.fromkeys(errors)) or text[-300:])[:600]


def available() -> bool:
    return extension() is not None


_TAKEN = (torch.float32, torch.bfloat16, torch.float16)  # the dtypes the kernels read


def takes(t: torch.Tensor) -> bool:
    """Whether the C++ kernels take ``t``: a CPU tensor of float32, bfloat16 or float16, and the extension built."""
    return t.dtype in _TAKEN and t.device.type == "cpu" and (built is not None if _tried else available())


def quantize(x: torch.Tensor, bits: int, group_size: int, stochastic: bool, seed: int):
    """``(codes, meta)`` of a contiguous CPU tensor (any shape: its elements in order), in the format of
    ``format.py``."""
    return built.quantize(x, bits, group_size, stochastic, seed, *step_factors(bits))


@functools.cache
def step_factors(bits: int) -> tuple[float, float]:
    """The kernel's step factors at ``bits``: of all ``2**bits - 1`` levels, and of one fewer (special groups)."""
    levels = (1 << bits) - 1
    return step_factor(levels), step_factor(levels - 1)


def dequantize(codes: torch.Tensor, meta: torch.Tensor, bits: int, group_size: int, shape, dtype: torch.dtype):
    """The decoded tensor, contiguous of ``shape`` (a number of elements, or a shape of that many)."""
    return built.dequantize(codes, meta, (shape,) if type(shape) is int else shape, dtype, bits, group_size)


@functools.cache
def _normal_shape(bits: int) -> tuple[list[float], int]:
    """The normal scheme's float32 factors at ``bits`` (``normal.py``'s, in the order of ``NormalShape``) and the
    intervals a tail."""
    f = _normal_factors(bits)
    order = ("k", "share", "tail", "last_tail", "inner_both", "inner_no_lower", "last_with_lower", "last_alone")
    return [f[key] for key in (*order, "last_special")], SHAPES[bits][1]


def normal_quantize(x: torch.Tensor, bits: int, group_size: int, stochastic: bool, seed: int):
    """``(codes, meta)`` of a contiguous CPU tensor in the normal scheme (``normal.py``), meta int32
    ``[n_groups, 3]``: the torch twin's bytes with ``stochastic=False``."""
    return built.normal_quantize(x, bits, group_size, stochastic, seed, *_normal_shape(bits))


def normal_dequantize(codes: torch.Tensor, meta: torch.Tensor, bits: int, group_size: int, shape, dtype: torch.dtype):
    """The normal scheme's decoded tensor, contiguous of ``shape`` (a number of elements, or a shape of that many):
    the torch twin's bits."""
    out = torch.empty(shape, dtype=dtype)
    built.normal_dequantize(codes, meta, out, bits, group_size, *_normal_shape(bits))
    return out


def uniform_variances(
    flat: torch.Tensor, widths: tuple[int, ...], group_size: int, stride: int = 1, scale: float = 1.0
) -> torch.Tensor:
    """``variance.uniform_variances`` of a contiguous CPU tensor, one sum a width in ``widths``' order (summed in
    float64, times ``scale``, as float32): of every group, or (``stride`` 2 or more) of the whole groups 0, ``stride``,
    ``2 stride``, ... (``variance.group_sample``'s sample, read where it lies)."""
    return built.uniform_variances(flat, group_size, *_uniform_factors(tuple(widths)), stride, scale)


def normal_variances(
    flat: torch.Tensor, widths: tuple[int, ...], group_size: int, stride: int = 1, scale: float = 1.0
) -> torch.Tensor:
    """``variance.normal_variances`` of a contiguous CPU tensor, as :func:`uniform_variances` gives them."""
    return built.normal_variances(flat, group_size, *_normal_factors_of(tuple(widths)), stride, scale)


def row_variances(flat: torch.Tensor, group_size: int, rows: int) -> torch.Tensor:
    """``free.row_variances`` of a contiguous CPU tensor: float32, one a row (each row's sum in float64)."""
    return built.row_variances(flat, group_size, rows)


def add_weighted_norms(total: torch.Tensor, g: torch.Tensor, weights: torch.Tensor) -> None:
    """``free.add_weighted_norms`` of contiguous CPU tensors."""
    built.add_weighted_norms(total, g, weights)


def inverse_variance(x: torch.Tensor, outer: int, channels: int, inner: int, eps: float) -> torch.Tensor:
    """``free.mean_inverse_variance`` of a contiguous CPU tensor seen as ``[outer, channels, inner]``."""
    return built.inverse_variance(x, outer, channels, inner, eps)


def kept_rows(n_rows: int, n_kept: int, seed: int, complement: bool) -> torch.Tensor:
    """``schemes.sketch.kept_rows`` on a CPU (``seed`` in ``[0, 2**63)``)."""
    return built.kept_rows(n_rows, n_kept, seed, complement)


@functools.cache
def _uniform_factors(widths: tuple[int, ...]) -> tuple[list[int], list[float], list[float]]:
    """The widths, and the step factors :func:`uniform_variances` passes for them (of all levels, of one fewer)."""
    return list(widths), [step_factors(b)[0] for b in widths], [step_factors(b)[1] for b in widths]


@functools.cache
def _normal_factors_of(widths: tuple[int, ...]) -> tuple[list[int], list[list[float]], list[int]]:
    """The widths, and the normal scheme's factors and tails :func:`normal_variances` passes for them."""
    shapes = [_normal_shape(b) for b in widths]
    return list(widths), [f for f, _ in shapes], [t for _, t in shapes]


def encode_bins(flat: torch.Tensor, edges: torch.Tensor, bits: int) -> torch.Tensor:
    """``torch.bucketize(flat, edges)`` packed ``8 / bits`` codes a byte (the layout of ``codes.py``)."""
    return built.encode_bins(flat, edges, bits)


def decode_table(packed: torch.Tensor, table: torch.Tensor, shape, bits: int) -> torch.Tensor:
    """``table[codes]`` of the codes packed by :func:`encode_bins`, contiguous of ``shape`` (a number of elements, or
    a shape of that many)."""
    return built.decode_table(packed, table, (shape,) if type(shape) is int else shape, bits)


def pack_bool(flat: torch.Tensor) -> torch.Tensor:
    """A contiguous bool tensor packed 8 to a byte, element ``8k + i`` in bit ``i`` of byte ``k`` (the layout of
    ``bitmask.py``)."""
    packed = torch.empty(-(-flat.numel() // 8), dtype=torch.uint8)
    built.pack_bool(flat, packed)
    return packed


# The tests of :func:`pack_compare`, by name: ``(kind, lo, hi)`` -> the kernel's KIND.
COMPARE_KINDS = {"gt": 0, "open": 1, "outside": 2, "closed": 3, "ge": 4, "le": 5}


def pack_compare(x: torch.Tensor, kind: str, lo: float, hi: float) -> torch.Tensor:
    """A contiguous float tensor's test against its bounds (``COMPARE_KINDS``: ``gt`` is ``x > lo``,
    ``open`` ``lo < x < hi``, ``outside`` not ``lo <= x <= hi``, ``closed`` ``lo <= x <= hi``, ``ge``
    and ``le`` one bound), packed as :func:`pack_bool` packs the bool result, without the bool tensor. The bounds
    are compared in float32: a float16 or bfloat16 tensor's must be exact in its dtype."""
    return built.pack_compare(x, COMPARE_KINDS[kind], lo, hi)


def unpack_bool(packed: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.empty(n, dtype=torch.bool)
    built.unpack_bool(packed, out)
    return out
