"""Kernels with the faults that ``gactx.kernels.aot`` must catch, compiled in a child process of the tests.

``python -m tests.kernels.aot_cases OUT.json`` compiles each for sm_90 and writes what ``Compiled.problems``
says of it. Run without ``TRITON_INTERPRET`` (the interpreter accepts every one of these faults but spills).
"""

import json
import sys
from dataclasses import replace

import triton
import triton.language as tl

from gactx.kernels.aot import KernelSpec, compile_spec, specs

SCALE = 2.0  # a plain Python global: the interpreter reads it, the compiler refuses


@triton.jit
def _plain_global(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs) * SCALE)


@triton.jit
def _multiply_add(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    tl.store(out_ptr + offs, x * 3.0 + 1.0)  # one fused multiply-add unless fusion is off


@triton.jit
def _masked_everywhere(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1.0, mask=offs < n)


@triton.jit
def _nan_minimum(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.minimum(tl.load(x_ptr + offs), 1.0, propagate_nan=tl.PropagateNan.ALL))


def _case(name, kernel, extra_ints, constexprs, options, wide="ld st"):
    signature = {"x_ptr": "*fp32", "out_ptr": "*fp32", **extra_ints, **dict.fromkeys(constexprs, "constexpr")}
    config = {"case": name, "rest": False}
    return KernelSpec("case", config, kernel, signature, constexprs, options, constexprs["BLOCK"], 8.0, True, wide)


CASES = [
    _case("plain_global", _plain_global, {}, {"BLOCK": 1024}, {"num_warps": 4, "enable_fp_fusion": False}),
    _case("multiply_add", _multiply_add, {}, {"BLOCK": 1024}, {"num_warps": 4, "enable_fp_fusion": True}),
    _case("masked_everywhere", _masked_everywhere, {"n": "i32"}, {"BLOCK": 1024}, {"num_warps": 4}),
    _case("nan_minimum", _nan_minimum, {}, {"BLOCK": 1024}, {"num_warps": 4}),
    _case("clean", _multiply_add, {}, {"BLOCK": 1024}, {"num_warps": 4, "enable_fp_fusion": False}),
]

# Stochastic 4-bit quantize (about 130 registers a thread) held to 40: ptxas must spill.
_QUANTIZE = next(s for s in specs(["quantize"], [4]) if s.config["stochastic"] and not s.config["rest"])
CASES.append(
    replace(_QUANTIZE, config={"case": "register_limit", "rest": False}, options={**_QUANTIZE.options, "maxnreg": 40})
)

if __name__ == "__main__":
    results = {spec.config["case"]: compile_spec(spec, 90) for spec in CASES}
    report = {
        name: {"problems": r.problems(), "spill_bytes": r.spill_bytes, "fma": r.fma, "nan_min_max": r.nan_min_max}
        for name, r in results.items()
    }
    with open(sys.argv[1], "w") as f:
        json.dump(report, f)
