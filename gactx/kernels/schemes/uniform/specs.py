"""The uniform scheme's kernels as ``aot.py`` compiles them: every configuration their launchers can choose."""

from __future__ import annotations

import itertools

from gactx.kernels.format import CODE_BITS, GROUP_SIZES
from gactx.kernels.schemes.uniform.dequantize import _dequantize_kernel, dequantize_launch
from gactx.kernels.schemes.uniform.quantize import _quantize_kernel, quantize_launch
from gactx.kernels.specs import DTYPES, POINTER, SIZE_SEED, KernelSpec, both, spec

__all__ = ["SPECS", "code_specs", "decode_specs", "seed_in_memory_specs"]


def code_specs(family, kernel, launcher, widths, meta_ptr, meta_bytes, bits_filter) -> list[KernelSpec]:
    """A quantize kernel's specs (the normal scheme's too: its codes are read the same way)."""
    out = []
    for name, dtype in DTYPES.items():
        pointers = {"x_ptr": POINTER[name], "codes_ptr": "*u8", "meta_ptr": meta_ptr}
        bits_list = [b for b in (bits_filter or widths) if b in widths]
        for bits, group, stochastic in itertools.product(bits_list, GROUP_SIZES, (False, True)):
            config = dict(dtype=name, bits=bits, group=group, stochastic=stochastic)
            for meta in both(launcher, dtype, bits, group, stochastic):
                # Bits a thread can load in one piece: a slice's width, or its share of the slice.
                width, threads = group // meta["SLICES"], meta["num_warps"] * 32
                run = min(width, meta["ROWS"] * width // threads) * dtype.itemsize * 8
                moved = dtype.itemsize + bits / 8 + meta_bytes / group
                out.append(spec(family, config, kernel, pointers, SIZE_SEED, meta, elements=meta["ROWS"] * group,
                                bytes_per_element=moved, exact=True, wide="ld", wide_bits=min(128, run)))  # fmt: skip
    return out


def decode_specs(family, kernel, launcher, widths, meta_ptr, meta_bytes, bits_filter) -> list[KernelSpec]:
    """A dequantize kernel's specs (the normal scheme's too)."""
    out = []
    for name, dtype in DTYPES.items():
        pointers = {"codes_ptr": "*u8", "meta_ptr": meta_ptr, "out_ptr": POINTER[name]}
        bits_list = [b for b in (bits_filter or widths) if b in widths]
        for bits, group in itertools.product(bits_list, GROUP_SIZES):
            for meta in both(launcher, dtype, bits, group):
                # Bits a thread can store in one piece: a plane's width (format.py), or its share of the plane.
                width, threads = group // (8 // bits), meta["num_warps"] * 32
                run = min(width, meta["ROWS"] * width // threads) * dtype.itemsize * 8
                out.append(spec(family, dict(dtype=name, bits=bits, group=group), kernel, pointers,
                                {"n": "i32", "full": "i32"}, meta, elements=meta["ROWS"] * group,
                                bytes_per_element=dtype.itemsize + bits / 8 + meta_bytes / group, exact=True,
                                wide="st", wide_bits=min(128, run)))  # fmt: skip
    return out


def seed_in_memory_specs(bits_filter=None) -> list[KernelSpec]:
    """The stochastic quantize that reads its seed on the device (``SEED_IN_MEMORY``: what a compiled graph captured
    by CUDA graphs launches), at 4 bits (or ``bits_filter``'s widths) in groups of 256, of each dtype, with and
    without a rest: one load a program more than the seed passed as a value."""
    out = []
    for s in code_specs("quantize", _quantize_kernel, quantize_launch, CODE_BITS, "*fp32", 8, bits_filter or (4,)):
        if s.config["stochastic"] and s.config["group"] == 256:
            signature = {k: "*i64" if k == "seed" else v for k, v in s.signature.items()}
            out.append(
                KernelSpec(
                    s.family,
                    {**s.config, "seed": "memory"},
                    s.kernel,
                    signature,
                    {**s.constexprs, "SEED_IN_MEMORY": True},
                    s.options,
                    s.elements,
                    s.bytes_per_element,
                    s.exact,
                    s.wide,
                    s.wide_bits,
                    table_loads=1,
                )
            )  # fmt: skip (the seed's load: 64 bits)
    return out


SPECS = {  # family -> specs, narrowed to some widths
    "quantize": lambda bits=None: (
        code_specs("quantize", _quantize_kernel, quantize_launch, CODE_BITS, "*fp32", 8, bits)
        + seed_in_memory_specs(bits)
    ),
    "dequantize": lambda bits=None: decode_specs(
        "dequantize", _dequantize_kernel, dequantize_launch, CODE_BITS, "*fp32", 8, bits
    ),
}
