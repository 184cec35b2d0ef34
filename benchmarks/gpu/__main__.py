"""``python -m benchmarks.gpu``: the GPU evaluation (see ``benchmarks/gpu/__init__.py``)."""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks.gpu import report, training
from benchmarks.gpu.harness import ArmRun, Deadline, child_command, emit, run_arm
from benchmarks.harness import Bench, add_output_options, check_output, results_folder, where

# The tests first: every figure rests on the kernels being right on the device (8 workers of a GPU machine's 16 cores,
# each compiling its own kernels). Sized from the first H100 run: kernels took 29 s; the host arm's compiled cases
# compile again at every turn. The adaptation arm then, and the traced format's host cost last, in what time is left:
# on the H200 every other arm ended well within its limit. "host-traced": L1 compiled with backend="torch"
# (benchmarks.host's L1+compile-torch: the format in Inductor's own kernels, Triton on a GPU, and a tick a save; its
# compile took 56 s on a 2-core CPU).
ARM_LIMITS_S = (
    {"tests": 120, "kernels": 40, "host": 60}
    | {name: arm.budget_s for name, arm in training.ARMS.items() if name != "baselines"}
    | {"adaptation": 45, "baselines": training.ARMS["baselines"].budget_s, "host-traced": 90}
)  # fmt: skip
TRACED = ("L1+compile-torch",)  # the host-traced arm's method (with eager L1 and the plain ones: host.methods)
HOST_WIDTHS, HOST_ROUNDS, HOST_STEPS = (64,), 3, 20  # the host arm: benchmarks.host's MLP (tiny: 64, 2 x 3)
BUDGET_S = 520  # the whole command: under 9 minutes of a loan of 15 that includes the machine's start
# --tiny on a 2-core CPU: every arm takes 10 to 70 s alone (the adaptive levels' first adaptations most of it),
# and more beside other work; its limits are the GPU's times this.
TINY_LIMITS = 5
MIN_ARM_S = 20  # an arm given less than this is not started (its imports and model alone take about that)
BENCH = Bench("gpu", None, quick=None)  # its environment record and results (benchmarks/harness.py)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny sizes: the same code in about a minute, on a CPU too")
    p.add_argument("--arms", nargs="+", choices=list(ARM_LIMITS_S), default=list(ARM_LIMITS_S),
                   help="arms to run, in this order (default: all)")  # fmt: skip
    p.add_argument("--limit", nargs="+", default=[], metavar="ARM=SECONDS", help="an arm's own time limit")
    p.add_argument("--budget-s", type=float, help=f"the whole command's time (default {BUDGET_S}; --tiny: 5x)")
    add_output_options(p)  # --out, --update-results: the benchmarks' one rule (benchmarks/harness.py)
    p.add_argument("--child", choices=list(ARM_LIMITS_S), help=argparse.SUPPRESS)
    p.add_argument("--limit-s", type=float, help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, help="torch threads of each arm's process (default: this one's)")
    args = p.parse_args(argv)
    check_output(p, args, "--tiny" if args.tiny else None)
    scale = TINY_LIMITS if args.tiny else 1
    args.limits = {arm: scale * seconds for arm, seconds in ARM_LIMITS_S.items()}
    args.budget_s = args.budget_s or scale * BUDGET_S
    for item in args.limit:
        arm, _, seconds = item.partition("=")
        if arm not in ARM_LIMITS_S or not seconds.replace(".", "", 1).isdigit():
            p.error(f"--limit {item!r}: give ARM=SECONDS with ARM one of {list(ARM_LIMITS_S)}")
        args.limits[arm] = float(seconds)
    if not args.tiny and not torch.cuda.is_available():
        p.error("no CUDA device here: a GPU figure comes only from a GPU (--tiny runs the same code at tiny sizes)")
    return args


def environment(tiny: bool) -> dict:
    """What the child measures on: device, versions, and how each figure is taken."""
    import importlib.metadata

    def version(package: str) -> str:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = device == "cuda"
    memory = torch.cuda.mem_get_info()[1] if cuda else 0
    return {"id": "env", "kind": "env"} | BENCH.environment(device) | {
        "capability": ".".join(map(str, torch.cuda.get_device_capability())) if cuda else None,
        "memory_gib": memory / (1 << 30), "triton": version("triton"),
        "transformers": version("transformers"), "peft": version("peft"), "tiny": tiny,
        "peak": "torch.cuda.max_memory_allocated over one training step (forward, backward, optimizer step), "
        "all the process holds included, gradients set to none before it" if cuda else
        "gactx.PeakMemory (the profiler's CPU allocations) over one step, above its start",
        "timing": f"median of {training.TIMED} steps after {training.WARMUP} warm-up steps, methods alternated in "
        f"{training.ROUNDS} rounds (compiled ones one after another); CUDA events, no synchronization between steps"
        if cuda else "time.perf_counter per step (a CPU: no GPU figure)",
        "max_batch": f"the largest batch whose {training.TRY_STEPS} steps run without an out-of-memory error, within "
        f"{training.TOLERANCE:.0%}" if cuda else f"CPU: a stand-in capacity of {training.TINY_CAPACITY:g}x plain's "
        "peak, to run the same search (no GPU figure)",
    }  # fmt: skip


def child(args: argparse.Namespace) -> int:
    """One arm, in this process; its rows go to stdout for the parent."""
    deadline = Deadline(args.limit_s - 2)
    if args.threads:
        torch.set_num_threads(args.threads)
    emit(environment(args.tiny))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        if args.child == "tests":
            from benchmarks.gpu import suite

            suite.run(device, args.tiny, deadline)
        elif args.child == "kernels":
            from benchmarks.gpu import kernels

            kernels.run(device, args.tiny, deadline)
        elif args.child in ("host", "host-traced"):
            host_arm(device, args.tiny, args.child)
        elif args.child == "adaptation":
            from benchmarks.gpu import adaptation

            adaptation.run(device, args.tiny, deadline)
        else:
            training.run(training.ARMS[args.child], device, args.tiny, deadline)
    except Exception as error:  # noqa: BLE001 - written into the results, then the arm fails
        traceback.print_exc()
        emit(
            {
                "id": f"{args.child}/error",
                "kind": "error",
                "arm": args.child,
                "error": f"{type(error).__name__}: {error}",
            }
        )
        return 1
    return 0


def host_arm(device: str, tiny: bool, arm: str = "host") -> None:
    """``benchmarks.host`` on this device: host cost a saved tensor, eager and compiled, a width at a time (``arm``
    ``"host-traced"``: L1 compiled with ``backend="torch"`` alone, :data:`TRACED`)."""
    from benchmarks import host

    widths, rounds, steps = ((64,), 2, 3) if tiny else (HOST_WIDTHS, HOST_ROUNDS, HOST_STEPS)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 8 * rounds + 32)
    traced = arm == "host-traced"
    for width in widths:
        for row in host.measure(width, device, rounds, steps, traced=traced, only=TRACED if traced else None):
            emit({"id": f"{arm}/{width}/{row['method']}", "kind": "host", "arm": arm, **row})


class Results:
    """The rows so far, written to gpu.json and gpu.md at every row (and gpu.png at the end of every arm)."""

    def __init__(self, args: argparse.Namespace, argv: list[str]) -> None:
        self.out: Path | None = args.out
        self.tiny = args.tiny
        self.update = args.update_results
        self.command = shlex.join(["python", "-m", "benchmarks.gpu", *argv])
        self.env: dict = {}
        self.rows: dict[str, dict] = {}
        self.arms: list[ArmRun] = []

    def add(self, row: dict) -> None:
        if row.get("kind") == "env":
            if not self.env:
                self.env = row | {"command": self.command}
            return
        self.rows.setdefault(row["id"], {}).update(row)
        label = row["id"]
        shown = {k: row[k] for k in ("per_s", "peak_bytes", "max_batch", "quantize_vs_clone", "errors") if k in row}
        print(f"  {label}: {json.dumps(shown, default=str)}", flush=True)
        self.write()

    def folder(self) -> Path | None:
        if self.out is None and self.env:  # the device is the arms' (their environment row): the parent never asks
            self.out = results_folder(None, self.env["device"], update=self.update, smoke=self.tiny)
        return self.out

    def write(self, plot: bool = False) -> None:
        out = self.folder()
        if out is None:
            return
        out.mkdir(parents=True, exist_ok=True)
        arms = [vars(a) for a in self.arms]
        rows = list(self.rows.values())
        BENCH.write(out, self.env, rows, report.render(rows, self.env, arms), indent=1, arms=arms)
        if plot and rows:
            report.plot(rows, self.env, out / "gpu.png")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.child:
        return child(args)
    results = Results(args, argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a terminated run still stops its arm's process
    start = time.monotonic()
    for name in args.arms:
        left = args.budget_s - (time.monotonic() - start)
        limit = min(args.limits[name], left)
        run = ArmRun(name, limit)
        results.arms.append(run)
        if limit < min(MIN_ARM_S, args.limits[name]):
            run.status = "not started (no time left)"
            continue
        print(f"gactx GPU evaluation: arm {name}, at most {limit:.0f} s", flush=True)
        threads = ["--threads", str(args.threads or torch.get_num_threads())]
        command = child_command(name, limit, *threads, *(["--tiny"] if args.tiny else []))
        ended = run_arm(name, limit, command, results.add)
        results.arms[-1] = ended
        results.write(plot=True)
    results.write(plot=True)
    out = results.folder()
    if out is not None:
        print((out / "gpu.md").read_text())
        print(where(out))
    return 0 if all(a.status == "done" and not a.errors for a in results.arms) else 1


if __name__ == "__main__":
    sys.exit(main())
