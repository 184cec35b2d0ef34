"""The Triton kernels as a named GPU runs them, from their compiled code; measured beside it when a GPU is here.

For each kernel and configuration (group 256, the default; unmasked programs, every program of a tensor but
its last): registers, SASS instructions an element, bytes moved an element, and for a tensor of
``--elements`` elements the time its bytes take at the device's bandwidth (memory) against the time its
instructions take to issue (issue); the larger bounds the kernel. Compiled for the device's architecture with
``gactx.kernels.aot`` (no GPU needed). On a CUDA machine the kernels also run and ``triton.testing.do_bench``
times them (median); without one that column says so: no GPU figure is ever made up.

    python -m benchmarks.kernels                      # H100 (sm_90)
    python -m benchmarks.kernels --gpu h200 a100      # several devices, one table each
    python -m benchmarks.kernels --gpu h100 h200 a100 --update-results   # the committed tables

Writes ``roofline.md``, ``roofline.json`` and ``roofline.csv`` under ``benchmarks/runs/<gpu>/`` (git-ignored), or
with ``--update-results`` under ``benchmarks/results/<gpu>/`` (the committed results).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from benchmarks.harness import Bench, where
from gactx import kernels
from gactx.kernels import aot

ELEMENTS = 1 << 26  # 64 Mi elements: a 256 MiB float32 activation, far past any cache


@dataclass(frozen=True)
class Device:
    """What bounds a kernel on one GPU: bytes a second, and warp instructions a second."""

    name: str
    arch: int
    sms: int
    clock_hz: float  # SM clock assumed: 1.755 GHz for H100/H200 (boost 1.98 GHz), the 1.41 GHz boost for A100
    bandwidth: float  # bytes a second (spec sheet)
    schedulers: int = 4  # warp instructions an SM issues a cycle

    @property
    def instructions_per_second(self) -> float:
        """Thread instructions a second: warp instructions times 32 lanes."""
        return self.sms * self.schedulers * 32 * self.clock_hz


DEVICES = {
    "a100": Device("A100 SXM 80GB", 80, 108, 1.41e9, 2.039e12),
    "h100": Device("H100 SXM", 90, 132, 1.755e9, 3.35e12),
    "h200": Device("H200 SXM", 90, 132, 1.755e9, 4.8e12),
}


def budget(device: Device, bytes_per_element: float) -> float:
    """Instructions an element a kernel can issue in the time its bytes take to move: above it, issue-bound."""
    return device.instructions_per_second / device.bandwidth * bytes_per_element


def pick(families: list[str], quick: bool) -> list[aot.KernelSpec]:
    """Unmasked variants at group size 256, fp32 and bf16; ``quick``: 4-bit fp32 (de)quantize, nothing else."""

    def wanted(config: dict) -> bool:
        if config["rest"] or config.get("group", 256) != 256 or config.get("dtype") == "fp16":
            return False
        return not quick or (config.get("bits") == 4 and config.get("dtype") == "fp32")

    if quick:
        families = [f for f in families if f in ("quantize", "dequantize")]
    return [spec for spec in aot.specs(families) if wanted(spec.config)]


def measured_ms(spec: aot.KernelSpec, elements: int) -> float:
    """Median milliseconds of one launcher call on ``elements`` elements, on this machine's GPU."""
    import triton.testing

    import gactx
    from gactx.kernels.bitmask import triton_pack_bool, triton_unpack_bool
    from gactx.kernels.half import triton_round_bf16

    c = spec.config
    dtype = aot.DTYPES.get(c.get("dtype", "fp32"))
    x = torch.randn(elements, device="cuda").to(dtype)
    if spec.family == "quantize":
        call = lambda: gactx.quantize(x, c["bits"], c["group"], stochastic=c["stochastic"], backend="triton")  # noqa: E731
    elif spec.family == "dequantize":
        q = gactx.quantize(x, c["bits"], c["group"], backend="triton")
        call = lambda: gactx.dequantize(q, backend="triton")  # noqa: E731
    elif spec.family == "round_bf16":
        call = lambda: triton_round_bf16(x, c["stochastic"], 1)  # noqa: E731
    elif spec.family == "pack_bool":
        mask = x > 0
        call = lambda: triton_pack_bool(mask)  # noqa: E731
    else:
        packed = triton_pack_bool(x > 0)
        call = lambda: triton_unpack_bool(packed, elements)  # noqa: E731
    return triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")


def rows_for(device: Device, specs: list[aot.KernelSpec], elements: int, measure: bool) -> list[dict]:
    rows = []
    for spec in specs:
        compiled = aot.compile_spec(spec, device.arch)
        per_element, moved = compiled.per_element, spec.bytes_per_element
        memory_us = elements * moved / device.bandwidth * 1e6
        issue_us = elements * per_element / device.instructions_per_second * 1e6
        row = {
            "kernel": spec.family,
            "configuration": " ".join(f"{k}={v}" for k, v in spec.config.items() if k != "rest"),
            "registers": compiled.registers,
            "instructions_per_element": round(per_element, 2),
            "bytes_per_element": round(moved, 3),
            "budget_per_element": round(budget(device, moved), 1),
            "memory_us": round(memory_us, 1),
            "issue_us": round(issue_us, 1),
            "bound": "memory" if memory_us >= issue_us else "issue",
            "problems": compiled.problems(),
            "measured_us": round(measured_ms(spec, elements) * 1e3, 1) if measure else None,
        }
        rows.append(row)
    return rows


def render(device: Device, rows: list[dict], env: dict) -> str:
    lines = [
        f"# gactx kernels on {device.name} (sm_{device.arch}), from the compiled code",
        "",
        f"- {device.name}: {device.bandwidth / 1e12:.2f} TB/s, {device.sms} SMs x {device.schedulers} warp "
        f"instructions a cycle at {device.clock_hz / 1e9:.3f} GHz = {budget(device, 1):.2f} instructions an "
        "element for each byte the element moves (the budget: below it, memory-bound)",
        f"- compiled with triton {env['triton']} for sm_{device.arch} on {env['compiled_on']}, {env['date']}",
        f"- times for a tensor of {env['elements']:,} elements; memory = bytes / bandwidth, issue = instructions / "
        "issue rate, whichever is larger bounds the kernel",
        f"- measured: {env['measured']}",
        "- unmasked programs (all of a tensor but its end, less than a program), group size 256",
        "",
        "| kernel | configuration | regs | instr/elem | bytes/elem | budget | memory us | issue us | bound "
        "| measured us |",
        "|---|---|--:|--:|--:|--:|--:|--:|---|--:|",
    ]
    for r in rows:
        measured = "-" if r["measured_us"] is None else f"{r['measured_us']:.1f}"
        cells = [r["kernel"], r["configuration"], str(r["registers"]), f"{r['instructions_per_element']:.1f}",
                 f"{r['bytes_per_element']:.2f}", f"{r['budget_per_element']:.1f}", f"{r['memory_us']:.1f}",
                 f"{r['issue_us']:.1f}", r["bound"], measured]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def run(argv: list[str] | None = None) -> dict[str, list[dict]]:
    bench = Bench("roofline", __doc__, quick="4-bit fp32 (de)quantize only", prog="python -m benchmarks.kernels")
    parser = bench.parser
    parser.add_argument("--gpu", nargs="+", choices=sorted(DEVICES), default=["h100"], help="default: h100")
    parser.add_argument("--family", nargs="+", choices=aot.FAMILIES, default=list(aot.FAMILIES))
    parser.add_argument("--elements", type=int, default=ELEMENTS, help="tensor size for the times")
    args = bench.parse(argv)
    if kernels.TRITON_INTERPRET:
        parser.error("compiling for a GPU needs the real JIT: unset TRITON_INTERPRET")
    here = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    specs = pick(args.family, args.quick)
    tables = {}
    for name in args.gpu:
        device = DEVICES[name]
        measure = here is not None and torch.cuda.get_device_capability()[0] * 10 == device.arch
        # The environment of the machine that compiled (and, where it has that GPU, timed) the kernels.
        env = bench.environment(
            "cuda" if measure else "cpu", triton=kernels.TRITON_VERSION, gpu=name,
            compiled_on="a machine with " + (here or "no GPU"), elements=args.elements,
            measured=f"on {here}, triton.testing.do_bench, median" if measure
            else f"not here ({here or 'no GPU on this machine'}): no measured time",
        )  # fmt: skip
        rows = rows_for(device, specs, args.elements, measure)
        table = render(device, rows, env)
        folder = bench.folder(args, name)
        bench.write(folder, env, rows, table, indent=1, device=name)
        print(table)
        print(where(folder))
        tables[name] = rows
    return tables


if __name__ == "__main__":
    run()
