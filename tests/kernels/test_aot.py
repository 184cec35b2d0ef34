"""gactx/kernels/aot.py: every Triton kernel compiles for sm_80 and sm_90 on this CPU machine, with no spill, no
fused multiply-add where bytes must match the torch twin, 128-bit accesses, and within its instruction budget.

The compiles run in child processes: this process runs kernels under the interpreter (tests/conftest.py),
whose kernels the compiler cannot take. Each compile starts from an empty Triton cache (``aot._compile``): a
cached kernel skips the front end, where a plain Python global fails.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gactx.kernels import aot
from gactx.kernels.format import CODE_BITS, GROUP_SIZES
from gactx.kernels.schemes.uniform.dequantize import dequantize_launch
from gactx.kernels.schemes.uniform.quantize import quantize_launch
from gactx.kernels.specs import OPTIONS

ROOT = Path(__file__).resolve().parents[2]
# What the suite compiles: every family, width, rounding, rest and dtype, for sm_90 (H100, H200) at the smallest, the
# usual and the largest group size, with the instruction budgets (aot.BUDGETS), and for sm_80 (A100) at the usual one.
# Every configuration for both took two thirds of the suite's time on two cores (about 20 of 26 minutes), over CI's
# 20. GACTX_AOT_ALL=1 compiles every configuration the launchers can choose, for both (as `python -m
# gactx.kernels.aot` does): run it after changing a kernel.
# GACTX_AOT_GROUPS=256,4096 narrows sm_90 to those sizes: CI's legs for the other Tritons (.ci/matrix), where a third
# of the compiles saves each leg about a minute and a half.
ALL = os.environ.get("GACTX_AOT_ALL") == "1"
NARROW = tuple(int(g) for g in os.environ.get("GACTX_AOT_GROUPS", "").split(",") if g)
assert set(NARROW) <= set(GROUP_SIZES), f"GACTX_AOT_GROUPS: each size one of {GROUP_SIZES}"
GROUPS = {90: None if ALL else NARROW or (32, 256, 4096), 80: None if ALL else (256,)}
# Chunks small enough for pytest-xdist to spread over two workers (quantize is two thirds of the work).
CHUNKS = [
    (("quantize",), [1], "without"),
    (("quantize",), [2], "without"),
    (("quantize",), [4], "without"),
    (("quantize",), [8], "without"),
    (("dequantize",), None, "without"),
    (("round_bf16", "pack_bool", "unpack_bool"), None, "without"),
    (("encode_bins", "encode_compare", "decode_table"), None, "without"),
    (aot.FAMILIES, None, "only"),
    (("normal_quantize",), [2], "without"),
    (("normal_quantize",), [4], "without"),
    (("normal_quantize",), [8], "without"),
    (("normal_dequantize",), None, "without"),
]


def _run(module: str, args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", module, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800
    )


@pytest.mark.slow
@pytest.mark.parametrize("arch", aot.ARCHS)
@pytest.mark.parametrize(
    ("families", "bits", "variants"),
    CHUNKS,
    ids=[f"{'+'.join(f)}-{'+'.join(map(str, b or ['all']))}-{v}" for f, b, v in CHUNKS],
)
def test_every_kernel_compiles_for_the_gpu(tmp_path, arch, families, bits, variants):
    out = tmp_path / "rows.json"
    args = ["--arch", str(arch), "--family", *families, "--variants", variants, "--json", str(out)]
    args += ["--bits", *map(str, bits)] if bits else []
    groups = GROUPS[arch]
    args += ["--groups", *map(str, groups)] if groups else []
    proc = _run("gactx.kernels.aot", args, tmp_path)
    assert out.exists(), proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    expected = [] if variants == "only" else aot.specs(families, bits, groups)
    expected += [] if variants == "without" else aot.variant_specs(families)
    assert len(rows) == len(expected), "a configuration the launchers can choose was not compiled"
    problems = [f"{r['family']} {r}: {r['problems']}" for r in rows if r["problems"]]
    assert not problems, "\n".join(problems[:20])
    assert proc.returncode == 0, proc.stderr[-3000:]
    budgeted = [r for r in rows if r["budget"] is not None]  # held to it by problems() above
    assert len(budgeted) == sum(aot.budget(s, arch) is not None for s in expected)
    assert all(r["sass"] > 0 for r in budgeted), "a kernel with an instruction budget was not counted"


def test_an_instruction_count_over_its_budget_is_a_problem():
    spec = next(s for s in aot.specs(["quantize"], [4], [256]) if s.config["stochastic"] and not s.config["rest"])
    per_thread, wide = spec.elements // spec.threads, {"load_bits": [128], "store_bits": [128]}
    assert aot.budget(spec, 90) == aot.BUDGETS["quantize"]
    within = aot.Compiled(spec, 90, sass=aot.BUDGETS["quantize"] * per_thread, **wide)
    over = aot.Compiled(spec, 90, sass=(aot.BUDGETS["quantize"] + 1) * per_thread, **wide)
    assert within.problems() == [] and any("over its budget" in p for p in over.problems())
    assert aot.budget(spec, 80) is None and aot.Compiled(spec, 80, sass=over.sass, **wide).problems() == []
    deterministic = next(s for s in aot.specs(["quantize"], [4], [256]) if not s.config["stochastic"])
    with_rest = next(s for s in aot.specs(["dequantize"], [4], [256]) if s.config["rest"])
    assert aot.budget(deterministic, 90) is None and aot.budget(with_rest, 90) is None


def test_what_each_triton_version_holds():
    """Triton 3.9 holds BUDGETS and no spill; 3.5 to 3.7 what ALLOWANCES states, and no more."""
    dequantize = next(s for s in aot.specs(["normal_dequantize"], [8], [512]) if s.config["dtype"] == "fp32")
    assert not dequantize.config["rest"]
    quantize = next(s for s in aot.specs(["normal_quantize"], [8], [2048]) if s.config["rest"])
    wide = {"load_bits": [128], "store_bits": [128]}
    assert aot.allowance("3.9.0") == aot.Allowance() and aot.allowance("3.7.1") == aot.ALLOWANCES[(3, 7)]
    assert aot.budget(dequantize, 90, "3.9.0") == aot.BUDGETS["normal_dequantize"] == 32
    assert aot.budget(dequantize, 90, "3.5.1") == aot.budget(dequantize, 90, "3.6.0") == 42
    assert not aot.allowance("3.5.1").spill_bytes and not aot.allowance("3.6.0").spill_bytes
    assert aot.budget(dequantize, 90, "3.7.1") == 42 and aot.budget(dequantize, 90, "3.7.1+git1234") == 42
    per_thread = dequantize.elements // dequantize.threads
    measured = aot.Compiled(dequantize, 90, sass=round(41.4 * per_thread), **wide)  # Triton 3.7.1's count
    assert measured.problems("3.7.1") == [] and any("over its budget of 32" in p for p in measured.problems("3.9.0"))
    spilled = aot.Compiled(quantize, 90, spill_bytes=8, **wide)
    assert spilled.problems("3.7.1") == [] and any("spills 8 bytes" in p for p in spilled.problems("3.9.0"))
    assert any("spills 16 bytes" in p for p in aot.Compiled(quantize, 90, spill_bytes=16, **wide).problems("3.7.1"))
    other = next(s for s in aot.specs(["quantize"], [8], [2048]) if s.config["rest"])
    assert any("spills 8 bytes" in p for p in aot.Compiled(other, 90, spill_bytes=8, **wide).problems("3.7.1"))


def test_the_checks_catch_each_fault(tmp_path):
    """A plain global, a fused multiply-add, masked (scalar) loads, a spill and a minimum that propagates NaN are
    each reported; a clean kernel is not: the checks above can fail."""
    out = tmp_path / "cases.json"
    proc = _run("tests.kernels.aot_cases", [str(out)], tmp_path)
    assert out.exists(), proc.stderr[-3000:]
    found = json.loads(out.read_text())
    assert "does not compile" in found["plain_global"]["problems"][0]
    assert found["multiply_add"]["fma"] > 0 and any("fused" in p for p in found["multiply_add"]["problems"])
    assert any("narrower than 128" in p for p in found["masked_everywhere"]["problems"])
    spilled = found["register_limit"]
    assert spilled["spill_bytes"] > 0 and any("spills" in p for p in spilled["problems"])
    nan = found["nan_minimum"]
    assert nan["nan_min_max"] > 0 and any("propagate NaN" in p for p in nan["problems"])
    assert found["clean"]["problems"] == []


def _constexprs(meta: dict) -> dict:
    return {k: v for k, v in meta.items() if k not in OPTIONS}


def test_specs_hold_every_configuration_the_launchers_choose():
    quantize = {tuple(s.config.values()): s for s in aot.specs(["quantize"])}
    dequantize = {tuple(s.config.values()): s for s in aot.specs(["dequantize"])}
    # dtypes, bits, groups, rounding, rest; and the seed read on the device: dtypes, rest (4 bits, groups of 256)
    assert len(quantize) == 3 * len(CODE_BITS) * len(GROUP_SIZES) * 2 * 2 + 3 * 2
    assert len(dequantize) == 3 * len(CODE_BITS) * len(GROUP_SIZES) * 2
    for n in (1, 300, 8192, 3 * 8192 + 5, 1 << 20):
        for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"), (torch.float16, "fp16")):
            for bits, group in ((4, 256), (1, 32), (8, 4096)):
                _, _, meta = quantize_launch(n, dtype, bits, group, True)
                assert quantize[(name, bits, group, True, meta["REST"])].constexprs == _constexprs(meta)
                _, _, meta = dequantize_launch(n, dtype, bits, group)
                assert dequantize[(name, bits, group, meta["REST"])].constexprs == _constexprs(meta)


def test_access_widths_are_read_from_ptx():
    ptx = """
	ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
	@%p1 ld.global.b16 { %rs1 }, [ %rd2 + 0 ];
	@!%p2 st.global.v2.b32 [ %rd3 + 0 ], { %r5, %r6 };
	st.global.b8 [ %rd4 + 0 ], { %rs2 };
	ld.global.L1::evict_last.v4.b32 { %r7, %r8, %r9, %r10 }, [ %rd5 + 0 ];
"""
    assert aot._access_bits(ptx) == {"ld": [128, 16, 128], "st": [64, 8]}
