"""What ``aot.py`` compiles: a :class:`KernelSpec` is one compiled variant of one Triton kernel, and what its code must
show. Each scheme folder lists its own kernels' specs (its ``specs.py``, which its registry entry's ``kernel_specs()``
gives); ``aot.py`` lists the shared kernels' (bool masks, bfloat16 rounding) and collects them all."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["DTYPES", "OPTIONS", "POINTER", "SIZE_SEED", "WHOLE", "KernelSpec", "both", "spec"]

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# How the launchers pass a tensor of each dtype: bfloat16 as its int16 bits (the interpreter has no bf16 math).
POINTER = {"fp32": "*fp32", "fp16": "*fp16", "bf16": "*i16"}
OPTIONS = ("num_warps", "enable_fp_fusion", "maxnreg")  # launch options among a launcher's meta-parameters
SIZE_SEED = {"n": "i32", "seed": "i64", "full": "i32"}  # sizes below 2**31; seeds drawn below 2**62
# A size that is a whole number of programs for every launcher, and one element more: the launch without a rest and
# the one with.
WHOLE = 1 << 24


@dataclass(frozen=True)
class KernelSpec:
    """One compiled variant of one kernel: what the launcher passes, and what its code must show."""

    family: str
    config: dict  # the launcher's choices, in words: dtype, bits, group, stochastic, masked
    kernel: object = field(repr=False, compare=False)
    signature: dict  # argument -> Triton type, "constexpr" for meta-parameters
    constexprs: dict
    options: dict  # num_warps, enable_fp_fusion
    elements: int  # elements a program
    bytes_per_element: float  # bytes the kernel moves to and from memory an element
    exact: bool  # its results must equal its torch twin's bit for bit: no fused multiply-add
    wide: str  # "ld", "st" or "ld st": the global accesses that must be 128 bits wide (without a tail)
    wide_bits: int = 128  # less where a thread's run of consecutive elements is shorter than 16 bytes
    aligned: bool = True  # pointers 16-byte aligned (what the JIT assumes of a fresh torch allocation)
    # Loads a thread makes of a table of a few values (a FewBit table's edges, read one by one or gathered): narrow by
    # nature, and up to this many are left out of the width check.
    table_loads: int = 0

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.config.items())

    @property
    def threads(self) -> int:
        return self.options["num_warps"] * 32


def spec(family: str, config: dict, kernel, pointers: dict, ints: dict, meta: dict, **kwargs) -> KernelSpec:
    """The spec of ``kernel`` launched with ``meta`` (a launcher's meta-parameters: constexprs and options)."""
    constexprs = {k: v for k, v in meta.items() if k not in OPTIONS}
    options = {k: v for k, v in meta.items() if k in OPTIONS}
    signature = {**pointers, **ints, **dict.fromkeys(constexprs, "constexpr")}
    return KernelSpec(family, {**config, "rest": meta["REST"]}, kernel, signature, constexprs, options, **kwargs)


def both(launcher: Callable[..., tuple[int, int, dict]], *args) -> list[dict]:
    """The meta-parameters ``launcher(n, *args)`` gives ``WHOLE`` elements (no rest) and ``WHOLE + 1`` (a rest)."""
    return [launcher(WHOLE, *args)[2], launcher(WHOLE + 1, *args)[2]]
