"""``quantize`` and ``dequantize``: validation, memory order and the choice between Triton and torch.

Both schemes run the same way: Triton kernels on CUDA (and under the interpreter when asked), the C++ kernels of
``cpu.py`` on CPU tensors with ``backend="cpp"`` or ``"auto"`` (``scheme="normal"``: the torch twin's bytes with
``stochastic=False``, much faster than it: ``docs/kernels.md``), the torch twins with
``backend="torch"`` or where the C++ kernels cannot be built."""

from __future__ import annotations

import functools

import torch

from gactx.kernels import _triton, cpu, native
from gactx.kernels.bitmask import torch_pack_bool, torch_unpack_bool, triton_pack_bool, triton_unpack_bool
from gactx.kernels.format import (
    QuantizedTensor,
    as_is_width,
    check_args,
    check_scheme,
    contiguous_order,
    memory_order,
    restore_order,
    restore_perm,
)
from gactx.kernels.half import torch_round_bf16, triton_round_bf16
from gactx.kernels.schemes.normal.reference import torch_normal_dequantize, torch_normal_quantize
from gactx.kernels.schemes.normal.triton import triton_normal_dequantize, triton_normal_quantize
from gactx.kernels.schemes.uniform.dequantize import dequantize_into, dequantize_launch, triton_dequantize
from gactx.kernels.schemes.uniform.format import allocate
from gactx.kernels.schemes.uniform.quantize import quantize_into, quantize_launch, triton_quantize
from gactx.kernels.schemes.uniform.reference import torch_dequantize, torch_quantize

__all__ = ["quantize", "dequantize", "BACKENDS"]

BACKENDS = ("auto", "triton", "cpp", "torch")
SEED_LIMIT = 1 << 62  # Philox takes a 64-bit seed; torch.Generator a non-negative int64
_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what the uniform scheme's Triton kernels read


def choose_backend(x: torch.Tensor, backend: str) -> str:
    """What runs for ``x``: ``"triton"`` (CUDA tensors, or ``TRITON_INTERPRET=1`` when asked), ``"cpp"`` (CPU
    tensors: the C++ kernels of ``cpu.py``, built on first use) or ``"torch"`` (the twins; also where the C++
    build is not possible, with a warning)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not allowed; allowed values are {BACKENDS}")
    if backend == "triton":
        _triton.require_triton(x)
        return "triton"
    if backend == "auto":
        if x.is_cuda and _triton.HAS_TRITON:
            return "triton"
        return "cpp" if x.is_cpu and (cpu.built is not None or cpu.available()) else "torch"
    if backend == "cpp":
        if x.device.type != "cpu":
            raise ValueError(f"backend='cpp' runs on CPU tensors, not {x.device.type}; use 'auto' or 'triton'")
        if not cpu.available():
            raise RuntimeError(
                "backend='cpp': the C++ CPU kernels could not be built (see the warning and "
                "docs/install.md#the-c-kernels-did-not-build); use 'torch'"
            )
    return backend


def _draw_seed() -> int:
    # Drawn from torch's CPU generator: reproducible under torch.manual_seed, no device synchronization.
    return int(torch.randint(0, SEED_LIMIT, (), dtype=torch.int64))


def quantize(
    x: torch.Tensor,
    bits: int,
    group_size: int = 256,
    *,
    stochastic: bool = True,
    seed: int | None = None,
    backend: str = "auto",
    scheme: str = "uniform",
) -> QuantizedTensor:
    """Compress ``x`` to ``bits`` per element; :func:`dequantize` gives it back.

    Args:
        x: a float32, float16, bfloat16 or bool tensor of any shape, strides and device (dense: not sparse,
            nested, meta, or a tensor subclass: a wrapper's data lives in other tensors, and any other subclass
            would come back as a plain tensor; ``nn.Parameter`` is taken). Its values are stored, not
            its autograd history: ``dequantize`` returns a tensor that does not require grad.
        bits: 1, 2, 4 or 8 for packed codes with a per-group ``(lo, step)``; 16 stores float32 as
            bfloat16 (fp16/bf16 as they are); 32 keeps ``x`` itself. Bool tensors are always packed
            losslessly to one bit an element, whatever ``bits`` says.
        group_size: consecutive elements (in memory order) that share ``(lo, step)``; a power of two
            from 32 to 4096.
        stochastic: stochastic rounding (unbiased, the default) or round half up (deterministic).
        seed: seed of the rounding noise; ``None`` draws one from torch's CPU generator.
        backend: ``"auto"`` (Triton for CUDA tensors, the C++ kernels for CPU tensors), ``"triton"``,
            ``"cpp"`` or ``"torch"`` (the reference twins).
        scheme: ``"uniform"`` (levels evenly spaced from the group's min to its max) or ``"normal"`` (levels
            placed by a normal fitted to the group, min and max outermost; bits 2, 4 or 8; 12 bytes of
            metadata a group instead of 8; see ``gactx/kernels/schemes/normal``).
    """
    check_args(x, bits, group_size)
    check_scheme(scheme, bits, x.dtype)
    if x.requires_grad:  # what is stored are values: decoding gives a tensor without autograd history
        x = x.detach()
    chosen = choose_backend(x, backend)
    if seed is None:
        seed = _draw_seed() if stochastic else 0
    elif isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed={seed!r} must be None or an int in [0, 2**62)")
    if scheme != "uniform" and x.dtype != torch.bool:
        return _quantize_normal(x, bits, group_size, stochastic, seed, chosen)
    return quantize_checked(x, bits, group_size, stochastic, seed, chosen)


def _quantize_normal(x: torch.Tensor, bits: int, group_size: int, stochastic: bool, seed: int, chosen: str):
    """:func:`quantize` with ``scheme="normal"`` of checked arguments (a float tensor, bits 2, 4 or 8)."""
    if chosen == "cpp":  # a contiguous tensor as it is, any other in memory order
        flat, dense_shape, perm = contiguous_order(x)
        data, meta = cpu.normal_quantize(flat, bits, group_size, stochastic, seed)
        return QuantizedTensor(data, meta, bits, group_size, x.shape, x.dtype, dense_shape, perm, "normal")
    flat, dense_shape, perm = memory_order(x)
    if chosen == "triton":
        interpret = _triton.interpreting(x)
        data, meta = triton_normal_quantize(flat.contiguous(), bits, group_size, stochastic, seed, interpret)
    else:
        data, meta = torch_normal_quantize(flat, bits, group_size, stochastic, seed)
    return QuantizedTensor(data, meta, bits, group_size, x.shape, x.dtype, dense_shape, perm, "normal")


def quantize_checked(x: torch.Tensor, bits: int, group_size: int, stochastic: bool, seed: int, chosen: str):
    """:func:`quantize` of arguments already checked, ``chosen`` the backend :func:`choose_backend` gave: what
    gactx's pack hook calls for every compressed tensor (the checks cost as much as a small tensor's kernel).
    ``x`` may require grad (a saved activation): its values are stored, never its history; a width at or above
    its own (32, or 16 of a 16-bit tensor) keeps ``x`` itself, so callers detach it first there."""
    dtype = x.dtype
    if chosen == "cpp" and bits <= 8 and dtype != torch.bool:  # the pack hook's usual call
        return _cpp_quantize(x, bits, group_size, stochastic, seed)
    if dtype != torch.bool and as_is_width(bits, dtype):
        return QuantizedTensor(x, None, bits, group_size, x.shape, dtype, x.shape, None)  # at or below the width
    if x.requires_grad:  # no autograd history for the views below
        x = x.detach()
    flat, dense_shape, perm = memory_order(x)
    if chosen == "cpp":  # bool masks, and float32 stored as bfloat16
        if dtype == torch.bool:
            data, meta, bits = cpu.pack_bool(flat.contiguous()), None, 1
        else:
            data, meta = torch_round_bf16(flat, stochastic, seed), None
        return QuantizedTensor(data, meta, bits, group_size, x.shape, dtype, dense_shape, perm)
    use_triton = chosen == "triton"
    interpret = _triton.interpreting(x)
    meta = None
    if dtype == torch.bool:
        data, bits = (triton_pack_bool(flat, interpret) if use_triton else torch_pack_bool(flat)), 1
    elif bits == 16:
        data = (
            triton_round_bf16(flat, stochastic, seed, interpret)
            if use_triton
            else torch_round_bf16(flat, stochastic, seed)
        )
    elif use_triton:
        data, meta = triton_quantize(flat, bits, group_size, stochastic, seed, interpret)
    else:
        data, meta = torch_quantize(flat, bits, group_size, stochastic, seed)
    return QuantizedTensor(data, meta, bits, group_size, x.shape, dtype, dense_shape, perm)


def _cpp_quantize(x: torch.Tensor, bits: int, group_size: int, stochastic: bool, seed: int) -> QuantizedTensor:
    """The C++ kernel's codes of a float CPU tensor at 1 to 8 bits (``x`` itself where contiguous, no view made)."""
    flat, dense_shape, perm = contiguous_order(x)
    codes, meta = cpu.quantize(flat, bits, group_size, stochastic, seed)
    return QuantizedTensor(codes, meta, bits, group_size, x.shape, x.dtype, dense_shape, perm)


def _cpp_dequantize(q: QuantizedTensor) -> torch.Tensor:
    """The C++ kernel's decoding of the uniform scheme's codes (its own call: every replayed save's unpack)."""
    out = cpu.built.dequantize(q.data, q.meta, q.dense_shape, q.dtype, q.bits, q.group_size)
    return out if q.perm is None else restore_perm(out, q.perm)


def bound_quantize(like: torch.Tensor, bits: int, group_size: int, stochastic: bool, backend: str):
    """:func:`quantize_checked` of tensors like ``like`` (its device; a float dtype), the backend chosen once, called
    as ``fn(x, seed)``: what a save replayed at every step calls (on a CPU, the C++ kernel's own call, its step factors
    bound: one Python call a save)."""
    chosen = choose_backend(like, backend)
    if chosen == "cpp" and 1 <= bits <= 8:
        full, special = cpu.step_factors(bits)

        def encode(x: torch.Tensor, seed: int) -> QuantizedTensor:
            if not x.is_contiguous():
                return _cpp_quantize(x, bits, group_size, stochastic, seed)
            codes, meta = cpu.built.quantize(x, bits, group_size, stochastic, seed, full, special)
            return QuantizedTensor(codes, meta, bits, group_size, x.shape, x.dtype, x.shape, None)

        return encode
    if chosen == "triton" and 1 <= bits <= 8 and like.dtype in _TRITON_DTYPES:

        def encode(x: torch.Tensor, seed: int) -> QuantizedTensor:  # a contiguous tensor read where it is
            if not x.is_contiguous():
                return quantize_checked(x, bits, group_size, stochastic, seed, "triton")
            codes, meta = quantize_flat(x, bits, group_size, stochastic, seed, "triton")
            return QuantizedTensor(codes, meta, bits, group_size, x.shape, x.dtype, x.shape, None)

        return encode
    return lambda x, seed: quantize_checked(x, bits, group_size, stochastic, seed, chosen)


def quantize_flat(x: torch.Tensor, bits: int, group_size: int, stochastic: bool, seed: int, chosen: str):
    """``(codes, meta)`` of the elements of ``x`` in memory order (contiguous, of any shape; the op a compiled graph
    calls, its arguments gactx's own): on Triton, its launch planned once for each size (:func:`_quantize_plan`), with
    no view or detach of ``x``; elsewhere :func:`quantize_checked` of ``x`` flattened."""
    n = x.numel()
    if chosen == "triton" and 1 <= bits <= 8 and x.dtype in _TRITON_DTYPES and n > 0 and x.is_contiguous():
        codes, meta = allocate(x, bits, group_size)
        quantize_into(x, codes, meta, seed, _quantize_plan(n, x.dtype, bits, group_size, stochastic, x.is_cpu))
        return codes, meta
    q = quantize_checked(x.reshape(-1), bits, group_size, stochastic, seed, chosen)
    return q.data, q.meta


def dequantize_flat(codes, meta, bits: int, group_size: int, shape, dtype: torch.dtype, chosen: str) -> torch.Tensor:
    """The elements of ``dtype`` that :func:`quantize_flat` stored, as a new contiguous tensor of ``shape``: on Triton,
    its launch planned once for each size, decoded straight into that tensor (no view of a flat one)."""
    size = torch.Size(shape)
    n = size.numel()
    if chosen == "triton" and 1 <= bits <= 8 and dtype in _TRITON_DTYPES and n > 0:
        out = torch.empty(size, dtype=dtype, device=codes.device)
        dequantize_into(codes, meta, out, _dequantize_plan(n, dtype, bits, group_size, codes.is_cpu))
        return out
    return dequantize(QuantizedTensor(codes, meta, bits, group_size, size, dtype, size, None), backend=chosen)


@functools.lru_cache(maxsize=1024)
def _quantize_plan(n: int, dtype, bits: int, group_size: int, stochastic: bool, on_cpu: bool) -> tuple:
    """:func:`quantize_launch` of a size, once: the launch a replayed save or a compiled graph's op makes at every
    step (a CPU tensor reaches Triton only under its interpreter)."""
    return quantize_launch(n, dtype, bits, group_size, stochastic, on_cpu and _triton.INTERPRET)


@functools.lru_cache(maxsize=1024)
def _dequantize_plan(n: int, dtype, bits: int, group_size: int, on_cpu: bool) -> tuple:
    """:func:`dequantize_launch` of a size, once."""
    return dequantize_launch(n, dtype, bits, group_size, on_cpu and _triton.INTERPRET)


def native_quantize(like: torch.Tensor, bits: int, group_size: int, stochastic: bool, backend: str):
    """The C++ kernel's quantize of :func:`bound_quantize` with the handle a replayed save returns (``csrc/saved.h``):
    called as ``packer(x, seed)``, it stores a contiguous CPU tensor like ``like`` and returns a handle whose
    ``unpack()`` decodes it (``None`` for any other tensor). A CUDA tensor's packer launches the Triton kernels from
    C++ (``native.quantize_packer``). ``None`` where neither serves ``like``."""
    if backend in ("auto", "triton") and not native.why_not(like):
        return native.quantize_packer(like, bits, group_size, stochastic)
    if bits in (1, 2, 4, 8) and choose_backend(like, backend) == "cpp":
        return cpu.built.Packer.quantized(bits, group_size, stochastic, *cpu.step_factors(bits))
    return None


def bound_dequantize(like: QuantizedTensor, backend: str = "auto"):
    """:func:`dequantize` of tensors stored like ``like`` (its device, scheme and metadata), the backend chosen once,
    called as ``fn(q)``: what a save replayed at every step decodes with (on a CPU, the C++ kernel's own call)."""
    chosen = choose_backend(like.data, backend)
    if like.meta is not None and like.scheme == "uniform" and chosen == "cpp":
        return _cpp_dequantize
    if like.meta is not None and like.scheme == "uniform" and chosen == "triton":

        def decode(q: QuantizedTensor) -> torch.Tensor:  # stored in its own order: decoded straight into its shape
            if q.perm is not None or q.meta is None or q.scheme != "uniform":
                return dequantize(q, backend=backend)
            return dequantize_flat(q.data, q.meta, q.bits, q.group_size, q.shape, q.dtype, "triton")

        return decode
    return lambda q: dequantize(q, backend=backend)


def dequantize(q: QuantizedTensor, *, backend: str = "auto") -> torch.Tensor:
    """Decode ``q`` into a tensor of its original shape, dtype and device (and strides, when dense)."""
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"dequantize expects a QuantizedTensor, got {type(q).__name__}")
    if q.meta is None and q.data.dtype == q.dtype:
        return q.data  # stored as is
    chosen = choose_backend(q.data, backend)
    if q.scheme == "normal" and q.meta is not None:
        if chosen == "cpp":
            dense = cpu.normal_dequantize(q.data, q.meta, q.bits, q.group_size, q.dense_shape, q.dtype)
            return restore_perm(dense, q.perm)
        if chosen == "triton":
            interpret = _triton.interpreting(q)
            flat = triton_normal_dequantize(q.data, q.meta, q.bits, q.group_size, q.numel, q.dtype, interpret)
        else:
            flat = torch_normal_dequantize(q.data, q.meta, q.bits, q.group_size, q.numel, q.dtype)
        return restore_order(flat, q)
    if chosen == "cpp" and q.meta is not None:
        return _cpp_dequantize(q)
    n = q.numel
    use_triton = chosen == "triton"
    interpret = _triton.interpreting(q)
    if q.dtype == torch.bool:
        if use_triton:
            flat = triton_unpack_bool(q.data, n, interpret)
        else:
            flat = cpu.unpack_bool(q.data, n) if chosen == "cpp" else torch_unpack_bool(q.data, n)
    elif q.meta is None:
        flat = q.data.to(q.dtype)  # bfloat16 storage of a float32 tensor
    elif use_triton:
        flat = triton_dequantize(q.data, q.meta, q.bits, q.group_size, n, q.dtype, interpret)
    else:
        flat = torch_dequantize(q.data, q.meta, q.bits, q.group_size, n, q.dtype)
    return restore_order(flat, q)
