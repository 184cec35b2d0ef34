"""Every Triton kernel of gactx compiled ahead of time for real GPUs, on a machine without one.

``triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", arch, 32))`` runs Triton's
front end, its optimizer and the ptxas that ships in the triton wheel: PTX and a cubin, with no GPU and no
driver. A launch on a GPU goes through the same front end, so a kernel that fails here fails there. The
interpreter (``TRITON_INTERPRET=1``) runs a kernel's Python and accepts what the compiler rejects (plain
Python globals, for one); this module refuses to run under it.

:func:`specs` lists every configuration the launchers can choose (both call the kernels' ``*_launch``
functions); :func:`compile_spec` compiles one and reads from the result what decides correctness and speed
on a GPU:

- registers and spills (ptxas's own report, ``-v``);
- fused multiply-adds in the PTX: ``q * step + lo`` fused rounds once, torch rounds twice, so a kernel whose
  bytes must equal its torch twin's has none;
- minima and maxima that propagate NaN in the PTX (``min.NaN``): the kernels rely on ``tl.minimum`` and
  ``tl.maximum`` skipping NaN (``min.f32``), which stands for a group's masked and non-finite elements
  (``_triton.interpreter_skips_nan``), so they have none;
- the width of its global loads or stores on 16-byte aligned pointers: 128 bits, or a thread moves too few
  bytes an instruction to reach memory bandwidth (every access of a variant without a rest; of one with a rest,
  whose masked program may load less, the widest);
- SASS instructions per element (``nvdisasm``): the kernels have no loops, so each thread of a program runs
  each instruction at most once; divided by the elements a thread handles. Counted on the variant without a rest
  (``REST`` false, ``_grid.py``: whole programs only, what every program but the last runs); the variant with
  one holds the masked program too, behind a branch on the program's index. Out-of-line subroutines
  (``$__internal_*``: IEEE division's slow path, taken for denormal or huge operands, once a group at most)
  are left out; branches inside the kernel are counted whole. Held to :data:`BUDGETS` on sm_90 (:func:`budget`;
  an older Triton to what :data:`ALLOWANCES` states);
  ``nvdisasm`` takes about 0.35 s a call, so by default only kernels with a budget are counted (``sass="all"``:
  every variant without a rest).

An H100 SXM issues 132 SMs x 4 warp instructions a cycle. A kernel moving ``B`` bytes an element at
3.35 TB/s is memory-bound while it needs fewer than about ``8.9 x B`` instructions an element at 1.755 GHz
(``benchmarks/roofline.py``); above that, issuing instructions takes longer than moving the bytes.

Compiled variants beyond the meta-parameters: the kernels do not specialize on the value of ``n`` or
``seed`` (``do_not_specialize``), so only their integer width (int32 below 2**31) and the pointers'
16-byte alignment make other variants; :func:`specs` compiles every meta-parameter set with aligned pointers
and int32 sizes, and :func:`variant_specs` one set a kernel with int64 sizes and unaligned pointers.

    python -m gactx.kernels.aot                            # every kernel, sm_80 and sm_90, a table
    python -m gactx.kernels.aot --arch 90 --family quantize --bits 4 --json out.json
    python -m gactx.kernels.aot --arch 80 --groups 256 --sass all   # instructions an element of every kernel
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from gactx.kernels import _triton, schemes
from gactx.kernels.bitmask import _pack_bool_kernel, _unpack_bool_kernel, bitmask_launch
from gactx.kernels.format import CODE_BITS, GROUP_SIZES
from gactx.kernels.half import _round_bf16_kernel, round_bf16_launch
from gactx.kernels.schemes.uniform.quantize import _advance_seed_kernel
from gactx.kernels.specs import DTYPES, POINTER, SIZE_SEED, KernelSpec, both, spec
from gactx.kernels.tables import (
    COMPARE_KINDS,
    COUNTED,
    _decode_table_kernel,
    _encode_bins_kernel,
    _encode_compare_kernel,
    decode_table_launch,
    encode_bins_launch,
    encode_compare_launch,
)

__all__ = [
    "ARCHS",
    "FAMILIES",
    "ALLOWANCES",
    "Allowance",
    "BUDGETS",
    "Compiled",
    "KernelSpec",
    "allowance",
    "budget",
    "compile_spec",
    "families",
    "specs",
    "variant_specs",
]

ARCHS = (80, 90)  # A100 and H100/H200: the GPUs gactx's users train on
# What the kernels are built to: SASS instructions an element on sm_90 (H100, H200), unmasked programs, for the
# stochastic 2- and 4-bit quantize and every dequantize of a family. The normal scheme (normal.py): two integer
# reductions, knots and a segment an element cost more: measured stochastic quantize 80-88 (issue-bound, about
# twice the ~40 that 4.5 bytes an element allow), and held there.
BUDGETS = {"quantize": 45, "dequantize": 25, "normal_quantize": 90, "normal_dequantize": 32}


@dataclass(frozen=True)
class Allowance:
    """What the kernels compiled by one Triton version hold instead of :data:`BUDGETS` and no spill, by family."""

    budgets: dict[str, int] = field(default_factory=dict)
    spill_bytes: dict[str, int] = field(default_factory=dict)


# By Triton's (major, minor) version, where it compiles worse than 3.9. Triton 3.5.1, 3.6.0 and 3.7.1 (what torch
# 2.9, 2.10 and 2.11, and 2.13 pin; 3.7.1 with ptxas 12.8) compute a normal dequantize group's knots in every thread
# that holds one of its elements, where 3.9 computes them once and shares them: up to 39.5 instructions an element
# under 3.5.1 and 3.6.0, 41.4 under 3.7.1 (8 bits, float32 out, groups of 256 and 512), below the 44.7 at which its
# 5.02 bytes an element stop being memory-bound on an H100. 3.7.1's ptxas keeps one register of the 8-bit normal
# quantize (float32, group 2048, to nearest, with a rest) on the stack across the call to IEEE division's slow path:
# 8 bytes a thread, once a program.
ALLOWANCES = {
    (3, 5): Allowance(budgets={"normal_dequantize": 42}),
    (3, 6): Allowance(budgets={"normal_dequantize": 42}),
    (3, 7): Allowance(budgets={"normal_dequantize": 42}, spill_bytes={"normal_quantize": 8}),
}


def allowance(version: str | None = None) -> Allowance:
    """What Triton ``version`` (by default the installed one) holds where it differs (:data:`ALLOWANCES`)."""
    major_minor = (_triton.VERSION if version is None else _triton.release(version))[:2]
    return ALLOWANCES.get(major_minor, Allowance())


def _round_bf16_specs(bits=None) -> list[KernelSpec]:
    pointers = {"x_ptr": "*fp32", "out_ptr": "*i16"}
    return [
        spec(
            "round_bf16",
            dict(stochastic=stochastic),
            _round_bf16_kernel,
            pointers,
            SIZE_SEED,
            meta,
            elements=meta["BLOCK"],
            bytes_per_element=6.0,
            exact=True,
            wide="ld st",
        )  # fmt: skip
        for stochastic in (False, True)
        for meta in both(round_bf16_launch, stochastic)
    ]


def _bitmask_specs(family: str, bits=None) -> list[KernelSpec]:
    kernel, names, wide = {
        "pack_bool": (_pack_bool_kernel, ("mask_ptr", "out_ptr"), "ld"),
        "unpack_bool": (_unpack_bool_kernel, ("packed_ptr", "out_ptr"), "st"),
    }[family]
    pointers = dict.fromkeys(names, "*u8")
    return [
        spec(
            family,
            {},
            kernel,
            pointers,
            {"n": "i32", "full": "i32"},
            meta,
            elements=meta["BLOCK"] * 8,
            bytes_per_element=1.125,
            exact=True,
            wide=wide,
        )  # fmt: skip
        for meta in both(bitmask_launch)
    ]


def _edge_loads(meta: dict, bits: int) -> int:
    """The loads of a table's edges a thread of the bins' encoding makes: one an edge where they are counted, else
    one a step of the binary search for each of its elements."""
    if meta["COUNT"] <= COUNTED:
        return meta["COUNT"]
    return meta["STEPS"] * (meta["BLOCK"] * 8 // bits) // (meta["num_warps"] * 32)


def _encode_bins_specs(bits=None) -> list[KernelSpec]:
    """FewBit's tables: ``2**bits - 1`` edges in the tensor's dtype."""
    return [
        spec("encode_bins", dict(dtype=name, bits=b), _encode_bins_kernel,
             {"x_ptr": POINTER[name], "edges_ptr": POINTER[name], "out_ptr": "*u8"}, {"n": "i32", "full": "i32"},
             meta, elements=meta["BLOCK"] * 8 // b, bytes_per_element=dtype.itemsize + b / 8, exact=True, wide="ld",
             table_loads=_edge_loads(meta, b))
        for name, dtype in DTYPES.items()
        for b in (bits or CODE_BITS)
        for meta in both(encode_bins_launch, b, (1 << b) - 1, dtype)
    ]  # fmt: skip


def _encode_compare_specs(bits=None) -> list[KernelSpec]:
    return [
        spec("encode_compare", dict(dtype=name, kind=kind), _encode_compare_kernel,
             {"x_ptr": POINTER[name], "out_ptr": "*u8"}, {"n": "i32", "full": "i32", "lo": "fp32", "hi": "fp32"},
             meta, elements=meta["BLOCK"] * 8, bytes_per_element=dtype.itemsize + 1 / 8, exact=True, wide="ld")
        for name, dtype in DTYPES.items()
        for kind in COMPARE_KINDS
        for meta in both(encode_compare_launch, kind, dtype)
    ]  # fmt: skip


def _decode_table_specs(bits=None) -> list[KernelSpec]:
    """Values moved as integers of their width: 16 bits (float16, bfloat16) and 32 (float32)."""
    return [
        spec("decode_table", dict(width=width, bits=b), _decode_table_kernel,
             {"packed_ptr": "*u8", "table_ptr": f"*i{width}", "out_ptr": f"*i{width}"}, {"n": "i32", "full": "i32"},
             meta, elements=meta["BLOCK"] * 8 // b, bytes_per_element=width / 8 + b / 8, exact=True, wide="st")
        for width in (16, 32)
        for b in (bits or CODE_BITS)
        for meta in both(decode_table_launch, b)
    ]  # fmt: skip


def _advance_seed_specs(bits=None) -> list[KernelSpec]:
    """The one-thread kernel that advances a device seed (before each quantize of a graph captured by CUDA graphs)."""
    return [KernelSpec("advance_seed", {"rest": False}, _advance_seed_kernel, {"seed_ptr": "*i64"}, {},
                       {"num_warps": 1}, 1, 16.0, True, "")]  # fmt: skip


_SHARED = {  # kernels of no one scheme: bool masks, table codes, bfloat16 rounding and the device seed
    "round_bf16": _round_bf16_specs,
    "pack_bool": lambda bits=None: _bitmask_specs("pack_bool"),
    "unpack_bool": lambda bits=None: _bitmask_specs("unpack_bool"),
    "encode_bins": _encode_bins_specs,
    "encode_compare": _encode_compare_specs,
    "decode_table": _decode_table_specs,
    "advance_seed": _advance_seed_specs,
}


def _builders() -> dict:
    """Every kernel family's specs: each registered scheme's (``Scheme.kernel_specs``), then the shared kernels'."""
    out = {}
    for name in schemes.names():
        out.update(schemes.scheme(name).kernel_specs())
    return out | _SHARED


def families() -> tuple[str, ...]:
    """The kernel families there are specs of, the registered schemes' included."""
    return tuple(_builders())


FAMILIES = families()  # the built-in schemes' and the shared kernels'


def specs(
    families: Iterable[str] = FAMILIES, bits: Iterable[int] | None = None, groups: Iterable[int] | None = None
) -> list[KernelSpec]:
    """Every meta-parameter set the launchers of ``families`` can choose (``bits`` narrows the schemes' kernels to
    some widths, ``groups`` to some group sizes)."""
    builders = _builders()
    unknown = [f for f in families if f not in builders]
    if unknown:
        raise ValueError(f"families={unknown!r}: the kernel families are {list(builders)}")
    wanted = None if groups is None else set(groups)
    out = [s for family in families for s in builders[family](bits)]
    return [s for s in out if wanted is None or "group" not in s.config or s.config["group"] in wanted]


def variant_specs(families: Iterable[str] = FAMILIES) -> list[KernelSpec]:
    """One meta-parameter set a kernel with int64 sizes, an int32 seed and unaligned pointers (a kernel with a size)."""
    out = []
    for family in families:
        spec = next((s for s in specs([family]) if s.config["rest"] and s.config.get("bits", 4) == 4), None)
        if spec is None:  # one thread, no size (advance_seed)
            continue
        ints = {k: {"n": "i64", "seed": "i32"}.get(k, v) for k, v in spec.signature.items()}
        config = {**spec.config, "sizes": "int64", "pointers": "unaligned"}
        out.append(
            KernelSpec(
                family,
                config,
                spec.kernel,
                ints,
                spec.constexprs,
                spec.options,
                spec.elements,
                spec.bytes_per_element,
                spec.exact,
                spec.wide,
                spec.wide_bits,
                aligned=False,
                table_loads=spec.table_loads,
            )  # fmt: skip
        )
    return out


def budget(spec: KernelSpec, arch: int, version: str | None = None) -> int | None:
    """The SASS instructions an element ``spec`` may take on ``sm_<arch>`` (:data:`BUDGETS`, or what Triton
    ``version`` holds instead: :func:`allowance`), or None where none is held: another architecture, a variant with a
    rest, a quantize that is not stochastic at 2 or 4 bits."""
    limit = allowance(version).budgets.get(spec.family, BUDGETS.get(spec.family))
    if limit is None or arch != 90 or spec.config.get("rest", True):
        return None
    if "dequantize" not in spec.family and not (spec.config.get("stochastic") and spec.config.get("bits") in (2, 4)):
        return None
    return limit


@dataclass
class Compiled:
    """What the compiled code of one spec shows, for one architecture."""

    spec: KernelSpec
    arch: int
    registers: int = 0
    spill_bytes: int = 0  # bytes of spill stores and loads a thread (ptxas)
    sass: int = 0  # instructions in the cubin, NOPs excluded
    fma: int = 0  # fused multiply-adds in the PTX
    nan_min_max: int = 0  # minima and maxima that propagate NaN in the PTX
    load_bits: list[int] = field(default_factory=list)  # width of each global load in the PTX
    store_bits: list[int] = field(default_factory=list)
    seconds: float = 0.0
    error: str | None = None

    @property
    def per_element(self) -> float:
        """SASS instructions a thread issues an element (see the module docstring)."""
        return self.sass / (self.spec.elements / self.spec.threads)

    def problems(self, version: str | None = None) -> list[str]:
        """What would fail or be slow on a GPU; empty when the kernel passes (compiled by Triton ``version``, by
        default the installed one: :func:`allowance`)."""
        if self.error:
            return [f"does not compile: {self.error}"]
        found = []
        if self.spill_bytes > allowance(version).spill_bytes.get(self.spec.family, 0):
            found.append(f"spills {self.spill_bytes} bytes of registers a thread to local memory")
        limit = budget(self.spec, self.arch, version)
        if limit is not None and self.per_element > limit:
            found.append(f"{self.per_element:.1f} SASS instructions an element, over its budget of {limit}")
        if self.spec.exact and self.fma:
            found.append(f"{self.fma} fused multiply-adds: results differ from the torch twin in the last bit")
        if self.nan_min_max:
            found.append(f"{self.nan_min_max} minima or maxima propagate NaN: the kernels rely on NaN being skipped")
        if self.spec.aligned:
            rest = self.spec.config["rest"]  # its masked program may load less: its unmasked one's accesses are wide
            for kind, widths in (("ld", self.load_bits), ("st", self.store_bits)):
                if kind == "ld" and 0 < sum(w < self.spec.wide_bits for w in widths) <= self.spec.table_loads:
                    widths = [w for w in widths if w >= self.spec.wide_bits]  # a table's loads: narrow by nature
                narrow = sorted({w for w in widths if w < self.spec.wide_bits})
                short = max(widths) < self.spec.wide_bits if rest and widths else bool(narrow)
                if kind in self.spec.wide.split() and (not widths or short):
                    found.append(f"global {kind} narrower than {self.spec.wide_bits} bits: {narrow or 'none'}")
        return found

    def row(self) -> dict:
        """A flat record for tables and JSON."""
        return {
            "family": self.spec.family,
            **self.spec.config,
            "arch": self.arch,
            "registers": self.registers,
            "spill_bytes": self.spill_bytes,
            "sass": self.sass,
            "per_element": round(self.per_element, 2),
            "budget": budget(self.spec, self.arch),
            "bytes_per_element": round(self.spec.bytes_per_element, 4),
            "fma": self.fma,
            "nan_min_max": self.nan_min_max,
            "widest_load": max(self.load_bits, default=0),
            "widest_store": max(self.store_bits, default=0),
            "seconds": round(self.seconds, 2),
            "problems": self.problems(),
        }


_ACCESS = re.compile(r"^\s*(?:@!?%p\d+\s+)?(ld|st)\.global\S*", re.MULTILINE)


def _access_bits(ptx: str) -> dict[str, list[int]]:
    """Width in bits of each global load and store in ``ptx`` (``ld.global.v4.b32`` is 128)."""
    found: dict[str, list[int]] = {"ld": [], "st": []}
    for match in _ACCESS.finditer(ptx):
        parts = match.group(0).split()[-1].split(".")
        vector = next((int(p[1:]) for p in parts if re.fullmatch(r"v\d", p)), 1)
        element = next(int(p[1:]) for p in reversed(parts) if re.fullmatch(r"[bsuf]\d+", p))
        found[match.group(1)].append(vector * element)
    return found


def _nvidia_tool(name: str, *args: str) -> str:
    path = getattr(_triton.triton.knobs.nvidia, name).path
    return subprocess.run([path, *args], check=True, capture_output=True, text=True).stdout


def _compile(source, arch: int, options: dict):
    """``triton.compile`` for ``sm_<arch>``, and the log of ptxas (``-v``: registers, stack frame, spills)."""
    from triton.backends.compiler import GPUTarget

    knobs = _triton.triton.knobs
    log, dump, cache = io.StringIO(), knobs.nvidia.dump_ptxas_log, knobs.cache.dir
    knobs.nvidia.dump_ptxas_log = True  # Triton prints ptxas's log: keep it
    # An empty cache: a cached kernel skips the front end, which is what rejects what the interpreter accepts.
    with tempfile.TemporaryDirectory(prefix="gactx-aot-") as empty:
        knobs.cache.dir = empty
        try:
            with contextlib.redirect_stdout(log):
                kernel = _triton.triton.compile(source, target=GPUTarget("cuda", arch, 32), options=dict(options))
        finally:
            knobs.nvidia.dump_ptxas_log, knobs.cache.dir = dump, cache
    return kernel, log.getvalue()


def ast_source(spec: KernelSpec):
    """What ``triton.compile`` takes for ``spec``: its kernel, signature and constexprs, and where the launcher's
    pointers are 16-byte aligned, that alignment (what the JIT assumes of a fresh torch allocation)."""
    from triton.compiler import ASTSource

    names = list(spec.signature)
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k, v in spec.signature.items() if v.startswith("*")}
    return ASTSource(spec.kernel, spec.signature, spec.constexprs, attrs if spec.aligned else None)


def compile_spec(spec: KernelSpec, arch: int, sass: str = "budgeted") -> Compiled:
    """Compile ``spec`` for ``sm_<arch>`` and read its resources, PTX and SASS; errors are recorded, not raised.
    ``sass``: count the SASS instructions of a kernel with a budget (``"budgeted"``), of every variant without a
    rest (``"all"``), or of none (``"none"``)."""
    if sass not in ("budgeted", "all", "none"):
        raise ValueError(f"sass={sass!r}: 'budgeted', 'all' or 'none'")
    if _triton.INTERPRET or not _triton.HAS_TRITON:
        raise RuntimeError("compiling for a GPU needs triton and the real JIT: run without TRITON_INTERPRET=1")
    result = Compiled(spec, arch)
    source = ast_source(spec)
    start = time.perf_counter()
    try:
        kernel, ptxas_log = _compile(source, arch, spec.options)
    except Exception as e:  # the compiler's verdict is the result: report it, compile the rest
        cause = e.__cause__ or e  # Triton wraps the front end's error (a NameError, say) with the source
        result.error = f"{type(cause).__name__}: {str(cause).strip()[:300]}"
        result.seconds = time.perf_counter() - start
        return result
    result.seconds = time.perf_counter() - start
    ptx = kernel.asm["ptx"]
    result.fma = len(re.findall(r"\bfma\.", ptx))
    result.nan_min_max = len(re.findall(r"\b(?:min|max)(?:\.\w+)*\.NaN\b", ptx))
    accesses = _access_bits(ptx)
    result.load_bits, result.store_bits = accesses["ld"], accesses["st"]
    # ptxas: "Used 72 registers", and for the kernel and each subroutine "8 bytes stack frame, 0 bytes spill
    # stores, 0 bytes spill loads". A stack frame alone is no spill: a call to IEEE division's slow path
    # saves registers there, on that path only.
    result.registers = max(int(n) for n in re.findall(r"Used (\d+) registers", ptxas_log))
    result.spill_bytes = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", ptxas_log))
    count = budget(spec, arch) is not None if sass == "budgeted" else sass == "all" and not spec.config["rest"]
    if count:  # nvdisasm takes ~0.35 s a call; the variant with a rest is counted without it
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            sass = _nvidia_tool("nvdisasm", "-c", f.name)
        kernel_body = re.split(r"^\$__internal", sass, flags=re.MULTILINE)[0]  # out-of-line subroutines follow
        instructions = re.findall(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.+?)\s*;", kernel_body, re.MULTILINE)
        result.sass = sum(1 for ins in instructions if not re.match(r"(@!?U?P\w+\s+)?NOP\b", ins))
    return result


def _table(results: list[Compiled]) -> str:
    lines = ["| kernel | configuration | sm | regs | spill B | instr/elem | bytes/elem | fma | ld/st bits | problems |"]
    lines.append("|---|---|--:|--:|--:|--:|--:|--:|---|---|")
    for r in results:
        widths = f"{max(r.load_bits, default=0)}/{max(r.store_bits, default=0)}"
        count = f"{r.per_element:.1f}" if r.sass else "-"
        cells = [r.spec.family, r.spec.label, str(r.arch), str(r.registers), str(r.spill_bytes),
                 count, f"{r.spec.bytes_per_element:.2f}", str(r.fma), widths,
                 "; ".join(r.problems()) or "-"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gactx.kernels.aot", description=" ".join(__doc__.split("\n\n")[0].split())
    )
    parser.add_argument("--arch", type=int, nargs="+", choices=ARCHS, default=list(ARCHS))
    parser.add_argument("--family", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--bits", type=int, nargs="+", choices=CODE_BITS, help="(de)quantize widths; default all")
    parser.add_argument("--groups", type=int, nargs="+", choices=GROUP_SIZES, help="group sizes; default all")
    parser.add_argument(
        "--variants", choices=("with", "without", "only"), default="with",
        help="the int64-size, unaligned-pointer variants (one a kernel): with the rest, without, or only them",
    )  # fmt: skip
    parser.add_argument(
        "--sass", choices=("budgeted", "all", "none"), default="budgeted",
        help="count SASS instructions (nvdisasm, ~0.35 s a kernel) of kernels with a budget, of all, or of none",
    )  # fmt: skip
    parser.add_argument("--json", help="write one record a compiled kernel to this file")
    args = parser.parse_args(argv)
    todo = [] if args.variants == "only" else specs(args.family, args.bits, args.groups)
    todo += [] if args.variants == "without" else variant_specs(args.family)
    results = [compile_spec(spec, arch, args.sass) for arch in args.arch for spec in todo]
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.row() for r in results], f, indent=1)
    print(_table(results))
    failed = [r for r in results if r.problems()]
    seconds = sum(r.seconds for r in results)
    print(f"\n{len(results)} kernels compiled in {seconds:.0f} s, {len(failed)} with problems", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
