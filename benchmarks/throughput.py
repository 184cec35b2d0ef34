"""Throughput of ``gactx.quantize`` and ``gactx.dequantize`` next to ``torch.clone``, the bandwidth ceiling.

GB/s counts every byte a call moves, in decimal gigabytes (1e9 bytes) a second, as bandwidth is quoted::

    quantize    reads the input (numel * itemsize)    writes q.nbytes (packed codes + 8 bytes a group)
    dequantize  reads q.nbytes                         writes the input's bytes
    clone       reads the input                        writes the input's bytes

so "vs clone" is the share of the attainable memory bandwidth an op reaches. On CUDA every op is timed by
``triton.testing.do_bench`` (median, L2 flushed between runs); on the CPU by a ``time.perf_counter`` timer
(one warm-up, then clone, quantize and dequantize in turn, round after round, and the median of each). On
the CPU gactx runs its C++ kernels (``gactx/kernels/cpu.py``); ``--backend torch`` times the torch twins,
a reference built from full-size temporaries. CPU figures say nothing about the GPU kernels.

    python -m benchmarks.kernels --throughput             # cuda when available, else cpu
    python -m benchmarks.kernels --throughput --update-results   # the same, into the committed results
    python -m benchmarks.kernels --throughput --quick --out /tmp/bench_quick
    python benchmarks/throughput.py --bits 2 4 --dtypes bf16 --sizes-mib 64 256

Writes kernels.csv, kernels.json and kernels.md (and kernels.png when matplotlib is installed) under
``--out``, by default ``benchmarks/runs/<device>/`` (``h100``, ``cpu``, ...; git-ignored), with
``--update-results`` the committed ``benchmarks/results/<device>/``, and prints the table.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import re
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: import the gactx of this checkout, installed or not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gactx  # noqa: E402
from benchmarks.device import device_name, device_slug  # noqa: E402
from benchmarks.harness import Bench, where  # noqa: E402
from gactx import kernels  # noqa: E402
from gactx.kernels import BACKENDS, CODE_BITS, GROUP_SIZES, cpu  # noqa: E402


def bench() -> Bench:
    """This benchmark's command and results (``benchmarks/harness.py``)."""
    what = "Quantize/dequantize throughput (GB/s) against torch.clone on the same input."
    quick = "0.0625, 0.25 MiB, bits 2 4, fp32, 1 repeat"
    return Bench("kernels", None, quick=quick, prog="python -m benchmarks.kernels --throughput", description=what)


MIB = 1 << 20
GB = 1e9
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GPU_SIZES_MIB = (1, 4, 16, 64, 256, 1024)
# The torch twins run at about 0.1 GB/s on two cores (a 64 MiB quantize takes 1-2 s), so the CPU sweep
# stops at 64 MiB: 32 cases with a warm-up and 3 repeats each finish in about two minutes.
CPU_SIZES_MIB = (1, 4, 16, 64)
QUICK = {"sizes_mib": [0.0625, 0.25], "bits": [2, 4], "dtypes": ["fp32"], "repeats": 1, "rep_ms": 10}
SLOW = {"sizes_mib": None, "bits": list(CODE_BITS), "dtypes": list(DTYPES), "repeats": 3, "rep_ms": 100}
SEED = 0x5EED  # a fixed rounding seed: the timer sees the kernel, not torch's generator drawing one
# Memory one case needs beyond its payload: the input, dequantize's output and clone's output (3x input).
# The torch path also holds ~8 full-size temporaries (padded fp32 copy, int64 positions, noise, int32
# codes, int64 packing sums): budget 48 bytes an element. do_bench allocates a 256 MiB buffer to flush L2.
TORCH_TEMP_BYTES_PER_ELEM = 48
# A 1 MiB clone takes ~10 us: a median of 3 such runs is one scheduler hiccup from noise, so short calls
# repeat for 0.2 s (at most 1000 runs); calls of a second or more stop at --repeats.
CPU_MIN_TIMED_S = 0.2
CPU_MAX_RUNS = 1000
# Other processes' share of the CPUs above which the table is flagged: with 2 cores and 2 torch threads, a
# neighbour holding one core makes every parallel op wait for a scheduler slice (ms, not us).
BUSY_SHARE = 0.10
DO_BENCH_FLUSH_BYTES = 256 * MIB
MEMORY_HEADROOM = 0.8  # use at most 80% of the memory free now: the allocator and the OS need slack

Timer = Callable[[Callable[[], object]], float]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    command = bench()
    parser = command.parser
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", choices=("cuda", "cpu"), default=default_device, help="default: %(default)s")
    parser.add_argument("--backend", choices=BACKENDS, default="auto", help="auto: triton on cuda, cpp on cpu")
    parser.add_argument("--bits", type=int, nargs="+", choices=CODE_BITS, help="default: 1 2 4 8")
    parser.add_argument("--dtypes", nargs="+", choices=tuple(DTYPES), help="default: fp32 bf16")
    sizes_help = f"input sizes in MiB; default {GPU_SIZES_MIB} on cuda, {CPU_SIZES_MIB} on cpu"
    parser.add_argument("--sizes-mib", type=float, nargs="+", help=sizes_help)
    parser.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=256, help="default: %(default)s")
    parser.add_argument("--repeats", type=int, help="cpu: timed runs per op, the median is kept (default 3)")
    parser.add_argument("--rep-ms", type=int, help="cuda: do_bench's time budget per op in ms (default 100)")
    args = command.parse(argv)
    check_device(parser, args)
    fill_defaults(args)
    args.out = command.folder(args, args.device)
    return args


def check_device(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse runs whose numbers would be mislabelled or meaningless."""
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device; CPU numbers are never labelled as GPU ones")
    if args.device == "cuda" and not kernels.HAS_TRITON:
        parser.error("timing on cuda uses triton.testing.do_bench; install triton")
    if args.device == "cpu" and args.backend == "triton" and not kernels.TRITON_INTERPRET:
        parser.error("--backend triton on cpu needs TRITON_INTERPRET=1 (the interpreter: correct, not fast)")


def fill_defaults(args: argparse.Namespace) -> None:
    """Options not given take the --quick values, or the full sweep's."""
    for name, value in (QUICK if args.quick else SLOW).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.sizes_mib is None:
        args.sizes_mib = list(GPU_SIZES_MIB if args.device == "cuda" else CPU_SIZES_MIB)
    args.backend = resolve_backend(args.device, args.backend)


def resolve_backend(device: str, backend: str) -> str:
    """The backend gactx will actually run: "auto" is triton on cuda (when installed), the C++ kernels on the
    CPU (the torch twins where they cannot be built)."""
    if backend == "auto":
        if device == "cuda":
            return "triton" if kernels.HAS_TRITON else "torch"
        return "cpp" if cpu.available() else "torch"
    return backend


def backend_label(args: argparse.Namespace) -> str:
    if args.backend == "triton" and args.device == "cpu":
        return "triton (interpreter: correctness tool, not a speed)"
    return args.backend


def environment(args: argparse.Namespace) -> dict:
    if args.device == "cuda":
        timer = f"triton.testing.do_bench, median over {args.rep_ms} ms of runs, L2 flushed between runs"
    else:
        timer = f"time.perf_counter, 1 warm-up, median of >= {args.repeats} run(s) and >= {CPU_MIN_TIMED_S:g} s"
    return bench().environment(
        args.device, backend=backend_label(args), triton=kernels.TRITON_VERSION or "not installed",
        group_size=args.group_size, rounding=f"stochastic, fixed seed {SEED}", timer=timer, sizes_mib=args.sizes_mib,
        cpus=os.cpu_count(), skipped=[],
    )  # fmt: skip


def cpu_time_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median of at least ``repeats`` runs, and of as many as fit in CPU_MIN_TIMED_S for short calls."""
    fn()  # warm-up: first-call allocations and dispatch caches
    times: list[float] = []
    deadline = time.perf_counter() + CPU_MIN_TIMED_S
    while len(times) < repeats or (time.perf_counter() < deadline and len(times) < CPU_MAX_RUNS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def alternating_ms(fns: list[Callable[[], object]], repeats: int) -> tuple[list[float], list[float]]:
    """Median milliseconds and minor page faults of each of ``fns``, run in turn round after round (at least
    ``repeats`` rounds, and as many as fit in CPU_MIN_TIMED_S), so that a busy spell of the machine slows them
    all alike. Page faults tell whether a call's output landed in fresh memory (each 4 KiB page is zeroed by
    the kernel on first touch: for a 64 MiB output that costs about as much as copying it)."""
    for fn in fns:
        fn()  # warm-up
    times: list[list[float]] = [[] for _ in fns]
    faults: list[list[int]] = [[] for _ in fns]
    deadline = time.perf_counter() + CPU_MIN_TIMED_S
    while len(times[0]) < repeats or (time.perf_counter() < deadline and len(times[0]) < CPU_MAX_RUNS):
        for fn, spent, faulted in zip(fns, times, faults, strict=True):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - start)
            faulted.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return [statistics.median(spent) * 1e3 for spent in times], [statistics.median(f) for f in faults]


def make_timer(args: argparse.Namespace) -> Timer:
    """Milliseconds a call takes: do_bench on cuda, the perf_counter timer on the CPU."""
    if args.device == "cpu":
        return functools.partial(cpu_time_ms, repeats=args.repeats)
    import triton.testing  # present: check_device refused cuda without triton

    return functools.partial(triton.testing.do_bench, warmup=25, rep=args.rep_ms, return_mode="median")


def cpu_clock() -> tuple[float, float, float] | None:
    """(wall, CPU seconds of every process on the machine, CPU seconds of this one), or None off Linux."""
    try:
        ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    busy = sum(ticks) - ticks[3] - ticks[4] - ticks[7]  # all but idle, iowait and steal
    own = os.times()
    return time.perf_counter(), busy / os.sysconf("SC_CLK_TCK"), own.user + own.system


def others_share(start: tuple[float, float, float] | None) -> float | None:
    """Share of all CPUs that other processes used since ``start``: a busy machine slows the CPU timings."""
    end = cpu_clock()
    if start is None or end is None or end[0] <= start[0]:
        return None
    others = (end[1] - start[1]) - (end[2] - start[2])
    return max(0.0, others) / ((end[0] - start[0]) * (os.cpu_count() or 1))


def free_bytes(device: str) -> int | None:
    """Memory free now on ``device``, or None where it cannot be read."""
    if device == "cuda":
        return torch.cuda.mem_get_info()[0]
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        found = re.search(r"^MemAvailable:\s*(\d+) kB", meminfo.read_text(), re.MULTILINE)
        if found:
            return int(found.group(1)) * 1024
    return None


def fits(numel: int, dtype: torch.dtype, args: argparse.Namespace) -> bool:
    """Whether the widest case (8 bits) of this input fits in the memory free now, with headroom."""
    need = 3 * numel * dtype.itemsize + gactx.expected_nbytes(numel, dtype, max(args.bits), args.group_size)
    need += TORCH_TEMP_BYTES_PER_ELEM * numel if args.backend == "torch" else 0
    need += DO_BENCH_FLUSH_BYTES if args.device == "cuda" else 0
    free = free_bytes(args.device)
    return free is None or need <= MEMORY_HEADROOM * free


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / GB


def measure(x: torch.Tensor, bits: int, clone_ms: float, args: argparse.Namespace, timer: Timer) -> dict:
    """One row: quantize and dequantize of ``x`` at ``bits``, against the clone time of the same input."""
    quantize = functools.partial(gactx.quantize, x, bits, args.group_size, seed=SEED, backend=args.backend)
    q = quantize()
    dequantize = functools.partial(gactx.dequantize, q, backend=args.backend)
    faults = None
    if args.device == "cpu":  # alternated with clone, in one process
        (clone_ms, quantize_ms, dequantize_ms), faults = alternating_ms([x.clone, quantize, dequantize], args.repeats)
    else:
        quantize_ms, dequantize_ms = timer(quantize), timer(dequantize)
    in_bytes, q_bytes = x.numel() * x.element_size(), q.nbytes
    clone_gbps = gbps(2 * in_bytes, clone_ms)
    quantize_gbps, dequantize_gbps = gbps(in_bytes + q_bytes, quantize_ms), gbps(q_bytes + in_bytes, dequantize_ms)
    return {
        "device": device_slug(x.device.type),
        "device_name": device_name(x.device.type),
        "backend": backend_label(args),
        "dtype": next(name for name, dtype in DTYPES.items() if dtype == x.dtype),
        "bits": bits,
        "group_size": args.group_size,
        "size_mib": in_bytes / MIB,
        "numel": x.numel(),
        "input_bytes": in_bytes,
        "quantized_bytes": q_bytes,
        "quantize_ms": quantize_ms,
        "dequantize_ms": dequantize_ms,
        "clone_ms": clone_ms,
        "quantize_gbps": quantize_gbps,
        "dequantize_gbps": dequantize_gbps,
        "clone_gbps": clone_gbps,
        "quantize_vs_clone": quantize_gbps / clone_gbps,
        "dequantize_vs_clone": dequantize_gbps / clone_gbps,
        "page_faults": faults,  # CPU: median minor faults a call of clone, quantize, dequantize
    }


def progress(cases: list[tuple[str, float, int]]) -> Iterable[tuple[str, float, int]]:
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional (the "bench" extra): plain iteration
        return cases
    return tqdm(cases, desc="kernels", unit="case")


def sweep(args: argparse.Namespace, skipped: list[str]) -> list[dict]:
    """Every (dtype, size, bits) case; one input and one clone timing per (dtype, size)."""
    timer, rows = make_timer(args), []
    current, x, clone_ms = None, None, 0.0
    for name, size_mib, bits in progress(list(itertools.product(args.dtypes, args.sizes_mib, args.bits))):
        dtype = DTYPES[name]
        if current != (name, size_mib):
            current, x = (name, size_mib), None  # drop the last input before measuring free memory
            if args.device == "cuda":
                torch.cuda.empty_cache()
            numel = int(size_mib * MIB) // dtype.itemsize
            if not fits(numel, dtype, args):
                skipped.append(f"{name} {size_mib:g} MiB (does not fit in free memory)")
                continue
            x = torch.randn(numel, dtype=dtype, device=args.device)
            clone_ms = timer(x.clone)
        if x is not None:
            rows.append(measure(x, bits, clone_ms, args, timer))
    return rows


def fmt(value: float) -> str:
    return f"{value:.3g}" if value < 1000 else f"{value:.0f}"


def render_markdown(rows: list[dict], env: dict) -> str:
    lines = [
        f"# gactx kernel throughput on {env['device_name']}",
        "",
        f"- device: `{env['device']}` ({env['device_name']}); backend actually used: {env['backend']}",
        f"- torch {env['torch']}, triton {env['triton']}; run {env['date']}",
        f"- group size {env['group_size']}, {env['rounding']}; timer: {env['timer']}",
        "- GB/s = (bytes read + bytes written) / time, 1 GB = 1e9 bytes; quantize reads the input and writes "
        "q.nbytes, dequantize the reverse, clone reads and writes the input (the bandwidth ceiling)",
    ]
    if env["device"] == "cpu":
        lines.append(
            "- CPU numbers, not GPU ones (the C++ CPU kernels; the torch twins are a reference with full-size "
            "temporaries, slow by design); clone, quantize and dequantize alternate round by round; sizes "
            f"{', '.join(f'{s:g}' for s in env['sizes_mib'])} MiB "
            f"(the default CPU sweep stops at {CPU_SIZES_MIB[-1]} MiB to finish in minutes)"
        )
    share = env["other_processes_cpu_share"]
    if share is not None:
        busy = f"; BUSY MACHINE (over {BUSY_SHARE:.0%}): timings are low" if share > BUSY_SHARE else ""
        lines.append(
            f"- other processes used {share:.0%} of the {env.get('cpus', os.cpu_count())} CPUs during the run{busy}"
        )
    lines += [f"- skipped: {s}" for s in env["skipped"]]
    lines += [
        "",
        "| dtype | bits | size MiB | kept | quantize GB/s | dequantize GB/s | clone GB/s "
        "| quantize/clone | dequantize/clone | page faults a call: clone, quantize, dequantize |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    order = list(DTYPES)
    for r in sorted(rows, key=lambda r: (order.index(r["dtype"]), r["bits"], r["size_mib"])):
        kept = f"{100 * r['quantized_bytes'] / r['input_bytes']:.1f}%"
        cells = [r["dtype"], str(r["bits"]), f"{r['size_mib']:g}", kept]
        cells += [fmt(r[k]) for k in ("quantize_gbps", "dequantize_gbps", "clone_gbps")]
        cells += [f"{r[k]:.3f}" for k in ("quantize_vs_clone", "dequantize_vs_clone")]
        faults = r.get("page_faults")
        cells.append(", ".join(f"{f:.0f}" for f in faults) if faults else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], env: dict, path: Path) -> bool:
    """GB/s against input size, one panel per dtype; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    dtypes = [name for name in DTYPES if any(r["dtype"] == name for r in rows)]
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4.5), squeeze=False)
    for ax, name in zip(axes[0], dtypes, strict=True):
        mine = [r for r in rows if r["dtype"] == name]
        for bits in sorted({r["bits"] for r in mine}):
            xs = [r["size_mib"] for r in mine if r["bits"] == bits]
            ax.plot(xs, [r["quantize_gbps"] for r in mine if r["bits"] == bits], "o-", label=f"quantize {bits}b")
            ax.plot(xs, [r["dequantize_gbps"] for r in mine if r["bits"] == bits], "s--", label=f"dequantize {bits}b")
        clones = {r["size_mib"]: r["clone_gbps"] for r in mine}
        ax.plot(list(clones), list(clones.values()), "k-", linewidth=2, label="torch.clone")
        ax.set(xscale="log", yscale="log", xlabel="input MiB", ylabel="GB/s", title=f"{name}, backend {env['backend']}")
        ax.legend(fontsize=7, loc="center left")  # mid-height at small sizes: between clone and the ops
    fig.suptitle(f"{env['device_name']}\ntorch {env['torch']}, triton {env['triton']}; {env['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_outputs(rows: list[dict], env: dict, table: str, out: Path) -> None:
    bench().write(out, env, rows, table)
    if rows and not plot(rows, env, out / "kernels.png"):
        print("matplotlib is not installed: no kernels.png")


def run(argv: list[str] | None = None) -> list[dict]:
    """Run the sweep that ``argv`` asks for, write its results, print the table; return the rows."""
    args = parse_args(argv)
    env = environment(args)
    print(f"gactx kernels on {env['device_name']}, backend {env['backend']}, writing to {args.out}", flush=True)
    clock = cpu_clock()
    rows = sweep(args, env["skipped"])
    env["other_processes_cpu_share"] = others_share(clock)
    table = render_markdown(rows, env)
    write_outputs(rows, env, table, args.out)
    print(table)
    print(where(args.out))
    return rows


if __name__ == "__main__":
    run()
