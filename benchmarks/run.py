"""Models benchmark: activation and peak memory, throughput, maximum batch and accuracy of GNNs,
transformers and CNNs trained at full precision, with gactx, with activation checkpointing and with
``save_on_cpu``, each in fp32 and under bf16 autocast.

    python -m benchmarks.run --help
    python -m benchmarks.run                                   # every model; full size on a GPU, small on a CPU
    python -m benchmarks.run --models bert-large --max-batch --memory-cap-gib 16
    python -m benchmarks.run --quick                           # tiny sizes, a few steps: checks that it runs
    python -m benchmarks.run --models llama-lora --merge --update-results   # one model's committed rows replaced,
                                                               # the others kept

Writes models.csv, models.json and models.md (and batch_throughput.png with --sweep) under
``benchmarks/runs/<device>/`` (git-ignored), or with ``--update-results`` under ``benchmarks/results/<device>/``
(the committed results), naming the device, torch and triton versions and the date.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
from operator import itemgetter
from pathlib import Path

import torch

import gactx
from benchmarks import workloads
from benchmarks.harness import Bench, alternate, kept_rows, read_results, where
from benchmarks.measure import count_saved_bytes, cuda_step_memory, max_batch, median_step_seconds
from benchmarks.methods import COMPILABLE, METHODS, Method
from gactx import kernels

MIB = 1 << 20


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    bench = Bench("run", __doc__, quick="tiny sizes, 4 steps", formatter_class=argparse.RawTextHelpFormatter)
    p = bench.parser
    p.add_argument("--models", nargs="+", choices=workloads.names(), default=workloads.names())
    # The checkpointing forms beyond the model's own are the GPU evaluation's peers (benchmarks/gpu): not by default.
    default = [m for m in METHODS if m not in ("checkpoint-fast", "checkpoint-selective")]
    p.add_argument("--methods", nargs="+", choices=METHODS, default=default)
    p.add_argument("--precisions", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"])
    p.add_argument("--size", choices=("full", "small", "tiny"), default="full" if cuda else "small")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if cuda else "cpu")
    p.add_argument("--batch", type=int, help="batch size (GNNs: nodes); default: the workload's")
    p.add_argument("--train-steps", type=int, default=30, help="steps trained before accuracy is measured")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (gactx's first adaptation is one)")
    p.add_argument("--timed", type=int, default=5, help="timed steps; the median is kept")
    p.add_argument("--max-batch", action="store_true", help="CUDA: search the largest batch that fits")
    p.add_argument("--memory-cap-gib", type=float, help="CUDA: cap the memory (as on a smaller GPU)")
    p.add_argument("--sweep", action="store_true", help="throughput at doubling batch sizes until OOM, plotted")
    p.add_argument("--merge", action="store_true",
                   help="keep the rows of the models not run from the results in the folder written")  # fmt: skip
    p.add_argument(
        "--compile", action="store_true",
        help="also run full precision and the gactx levels (fp32) with the model's forward under torch.compile",
    )  # fmt: skip
    args = bench.parse(argv)
    if args.quick:
        args.size, args.train_steps, args.warmup, args.timed = "tiny", 4, 1, 2
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    if (args.max_batch or args.memory_cap_gib) and args.device != "cuda":
        p.error("--max-batch and --memory-cap-gib measure the CUDA allocator: they need --device cuda")
    args.folder = bench.folder(args, args.device)
    return args


def train_step(method: Method, optimizer, inputs, target) -> float:
    w = method.workload
    with method.forward():
        loss = w.loss(w.model, inputs, target)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    method.after_step(inputs, target)
    return float(loss.detach())


def saved_bytes(method: Method, inputs, target) -> dict:
    """Activation bytes of one forward pass: the allocator on CUDA, the accounting on the CPU."""
    w = method.workload
    if method.device_type == "cuda":

        def forward():
            with method.forward():
                return w.loss(w.model, inputs, target)

        mem = cuda_step_memory(forward, lambda loss: loss.backward())
        w.model.zero_grad(set_to_none=True)
        row = {"activation_mib": mem.activation_bytes / MIB, "peak_mib": mem.peak_bytes / MIB}
        row["static_mib"] = mem.static_bytes / MIB
    elif method.controller is not None:
        with method.forward():
            w.loss(w.model, inputs, target).backward()
        stats = method.controller.memory_stats()
        row = {"activation_mib": stats.packed_bytes / MIB, "plain_activation_mib": stats.original_bytes / MIB}
    else:
        with method.forward():
            count, loss = count_saved_bytes(w.model, lambda: w.loss(w.model, inputs, target))
        loss.backward()
        row = {"activation_mib": count / MIB}
        if method.name == "checkpoint":
            row["note"] = "CPU count sees only what is saved outside the checkpointed blocks"
    if method.device_type != "cuda":  # the step's peak from the CPU allocator's events (gactx.PeakMemory)
        w.model.zero_grad(set_to_none=True)
        with gactx.PeakMemory("cpu") as meter:
            with method.forward():
                loss = w.loss(w.model, inputs, target)
            loss.backward()
        row["peak_mib"] = meter.peak / MIB
    w.model.zero_grad(set_to_none=True)
    return row


TRAIN_SEED = 0  # every run's dropout draws: the same for each method, whatever ran before it


def _random_as_eager():
    """Inductor's random ops drawing from torch's global RNG as eager ops do (its own are seeded apart)."""
    from torch._inductor import config

    return config.patch(fallback_random=True)


def run_one(
    name: str, method_name: str, precision: str, args: argparse.Namespace, compiled: bool = False,
    keep: list | None = None,
) -> dict:  # fmt: skip
    """One model trained one way: its step time, saved bytes, final loss and accuracy. Every run draws the same
    dropout masks (the global RNG seeded with ``TRAIN_SEED`` before its first step; a compiled run's random ops
    draw from it as eager ones do, Inductor's ``fallback_random``), so its rows differ by the method alone.
    ``keep``: a list the trained run is appended to, suspended, as ``(method, step)`` for :func:`alternated_step_ms`
    to time (it then closes it), instead of closed here: an adaptive level's first adaptation is not paid twice."""
    w = workloads.build(name, args.size, args.device)
    batch = args.batch or w.default_batch
    method = Method(method_name, w, precision, compiled)
    gen = torch.Generator().manual_seed(0)
    optimizer = torch.optim.Adam(w.model.parameters(), lr=w.lr)
    row = {"model": name, "size": args.size, "method": method.label, "batch": batch}
    random = _random_as_eager() if compiled else contextlib.nullcontext()
    try:
        with random:
            torch.manual_seed(TRAIN_SEED)
            inputs, target = w.make_batch(batch, gen)
            losses = [train_step(method, optimizer, inputs, target) for _ in range(args.warmup)]
            seconds = median_step_seconds(
                lambda: losses.append(train_step(method, optimizer, inputs, target)),
                args.timed, 0, args.device == "cuda",
            )  # fmt: skip
            row |= {"step_ms": seconds * 1e3, "samples_per_s": batch / seconds}
            row |= saved_bytes(method, inputs, target)
            for _ in range(max(0, args.train_steps - len(losses))):
                losses.append(train_step(method, optimizer, *w.make_batch(batch, gen)))
            held_out = w.make_batch(batch, torch.Generator().manual_seed(12345))
            row |= {"final_loss": sum(losses[-3:]) / len(losses[-3:]), "accuracy": workloads.accuracy(w, *held_out)}
            if args.max_batch:
                fits = lambda b: _fits(name, method_name, precision, b, args, compiled=compiled) is not None  # noqa: E731
                row["max_batch"], _ = max_batch(fits, batch)
            if args.sweep:
                row["sweep"] = _sweep(name, method_name, precision, batch, args, compiled)
    except BaseException:
        method.close()
        raise
    if keep is None:
        method.close()
    else:
        method.suspend()
        keep.append((method, functools.partial(train_step, method, optimizer, inputs, target)))
    return row


def alternated_step_ms(
    name: str, method_names: list[str], precision: str, args: argparse.Namespace, compiled: bool = False,
    rounds: int = 5, steps: int = 2, trained: list | None = None,
) -> dict[str, float]:  # fmt: skip
    """Median step time (ms) of each method, timed in turns: a fresh model each, ``args.warmup`` steps each
    (gactx's first adaptation among them), then ``rounds`` rounds of ``steps`` steps of every method in turn,
    so that whatever else the machine does falls on each method alike. One method's gactx hooks are installed
    at a time (saved-tensor hooks act on every model of the thread). ``trained``: the runs :func:`run_one` kept,
    timed instead of fresh ones (their warm-up steps are then past any first adaptation); closed here."""
    runs = [(method, step, None) for method, step in trained or []]
    try:
        for method_name in [] if trained else method_names:
            w = workloads.build(name, args.size, args.device)
            method = Method(method_name, w, precision, compiled)
            method.suspend()
            optimizer = torch.optim.Adam(w.model.parameters(), lr=w.lr)
            inputs, target = w.make_batch(args.batch or w.default_batch, torch.Generator().manual_seed(0))
            runs.append((method, functools.partial(train_step, method, optimizer, inputs, target), None))
        for method, step, _ in runs:  # after every Method is made: each compiled one resets TorchDynamo
            with method.active():
                for _ in range(max(1, args.warmup)):
                    step()

        def turn(method: Method, step) -> float:
            with method.active():
                return median_step_seconds(step, steps, 0, args.device == "cuda")

        times = alternate({m.name: functools.partial(turn, m, step) for m, step, _ in runs}, rounds)
    finally:
        for method, _, _ in runs:
            method.close()
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def _fits(
    name: str, method_name: str, precision: str, batch: int, args, timed: int = 0, compiled: bool = False
) -> float | None:
    """Seconds per step at ``batch`` (a fresh model, one step after one warm-up), or None on OOM."""
    try:
        w = workloads.build(name, args.size, args.device)
        method = Method(method_name, w, precision, compiled)
        try:
            optimizer = torch.optim.Adam(w.model.parameters(), lr=w.lr)
            inputs, target = w.make_batch(batch, torch.Generator().manual_seed(0))
            step = lambda: train_step(method, optimizer, inputs, target)  # noqa: E731
            return median_step_seconds(step, max(timed, 1), 1, args.device == "cuda")
        finally:
            method.close()
    except torch.cuda.OutOfMemoryError:
        return None
    finally:
        if args.device == "cuda":
            torch.cuda.empty_cache()


def _sweep(name: str, method_name: str, precision: str, start: int, args, compiled: bool = False) -> list[list]:
    """[batch, samples/s or None for OOM] at doubling batch sizes from a quarter of ``start``."""
    points, batch = [], max(2, start // 4)  # BatchNorm needs two samples to train
    for _ in range(12 if args.device == "cuda" else 3):
        seconds = _fits(name, method_name, precision, batch, args, timed=args.timed, compiled=compiled)
        points.append([batch, None if seconds is None else batch / seconds])
        if seconds is None:
            break
        batch *= 2
    return points


def variant(label: str) -> str:
    """What a method's label adds to its name (``Method.label``: the name, then ``+bf16``, then ``+compile``; a name
    may hold a ``+`` of its own, ``checkpoint+L1``)."""
    suffix = ""
    for part in ("+compile", "+bf16"):
        if label.endswith(part):
            suffix, label = part + suffix, label.removesuffix(part)
    return suffix


def compare(rows: list[dict]) -> None:
    """Activation ratio and throughput relative to full precision of the same model and precision."""
    for row in rows:
        suffix = variant(row["method"])
        base = next((r for r in rows if r["model"] == row["model"] and r["method"] == f"fp{suffix}"), None)
        if base is None or "step_ms" not in row:
            continue
        if row.get("activation_mib"):
            row["activation_ratio"] = base["activation_mib"] / row["activation_mib"]
        row["relative_throughput"] = row["samples_per_s"] / base["samples_per_s"]


COLUMNS = [
    ("model", "model", "{}"), ("method", "method", "{}"), ("batch", "batch", "{}"),
    ("activation_mib", "activations MiB", "{:.3g}"), ("activation_ratio", "vs fp", "{:.2f}x"),
    ("peak_mib", "peak MiB", "{:.4g}"), ("step_ms", "step ms", "{:.3g}"),
    ("relative_throughput", "throughput vs fp", "{:.2f}x"), ("max_batch", "max batch", "{}"),
    ("final_loss", "loss", "{:.3f}"), ("accuracy", "accuracy", "{:.1%}"),
]  # fmt: skip


def _merged(folder: Path, rows: list[dict], env: dict) -> list[dict]:
    """``rows`` after the rows of ``folder``'s models.json whose models ``rows`` lack; ``env["kept"]``: those models'
    run dates."""
    old = read_results(folder, "models")
    if old is None:
        return rows
    kept, env["kept"] = kept_rows(old, "rows", "kept", itemgetter("model"), {r["model"] for r in rows})
    return kept + rows


def render(rows: list[dict], env: dict) -> str:
    used = [c for c in COLUMNS if any(c[0] in r for r in rows)]
    kept = {}
    for model, date in env.get("kept", {}).items():
        kept.setdefault(date, []).append(model)
    lines = [
        f"# gactx models benchmark on {env['device_name']}",
        "",
        f"- torch {env['torch']}, triton {env['triton']}; run {env['date']}; size {env['size']}",
        f"- {env['memory']}",
        f"- throughput: median of {env['timed']} steps after {env['warmup']} warm-up steps; accuracy on a "
        f"held-out generated batch after {env['train_steps']} steps",
        *(f"- {', '.join(models)}: from the run of {date}" for date, models in kept.items()),
        "",
        "| " + " | ".join(c[1] for c in used) + " |",
        "|" + "|".join("---" if c[0] in ("model", "method") else "--:" for c in used) + "|",
    ]
    for r in rows:
        cells = [c[2].format(r[c[0]]) if r.get(c[0]) is not None else "" for c in used]
        lines.append("| " + " | ".join(cells) + " |")
    notes = sorted({r["note"] for r in rows if r.get("note")})
    return "\n".join(lines + [""] + [f"- {n}" for n in notes]) + "\n"


def plot(rows: list[dict], path: Path, env: dict) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    models = sorted({r["model"] for r in rows if r.get("sweep")})
    if not models:
        return False
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for r in (r for r in rows if r["model"] == model and r.get("sweep")):
            ok = [(b, t) for b, t in r["sweep"] if t is not None]
            style = "--" if r["method"].endswith("+bf16") else "-"
            line = ax.plot(*zip(*ok, strict=True), style, marker="o", label=r["method"])[0] if ok else None
            oom = [b for b, t in r["sweep"] if t is None]
            if oom:
                ax.plot(oom, [ok[-1][1] if ok else 0] * len(oom), "x", color=line.get_color() if line else "k", ms=10)
        ax.set(xscale="log", xlabel="batch size (x: out of memory)", ylabel="samples / s", title=model)
        ax.legend(fontsize=7)
    fig.suptitle(f"batch size vs throughput, {env['device_name']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def run(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.memory_cap_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap_gib * (1 << 30) / total))
    memory = (
        "activation and peak memory from the CUDA allocator (peak above the memory held at the step's start)"
        if args.device == "cuda"
        else "CPU: activation bytes are plain PyTorch's saved storages counted by a hook, gactx's by its own "
        "accounting; peak memory: gactx.PeakMemory over a forward and backward (the running sum of the CPU "
        "allocator's events, above what was allocated at the start); maximum batch and GPU throughput await a GPU"
    )
    bench = Bench("models", __doc__)
    env = bench.environment(args.device, triton=kernels.TRITON_VERSION or "not installed", size=args.size,
                            memory=memory, timed=args.timed, warmup=args.warmup, train_steps=args.train_steps,
                            memory_cap_gib=args.memory_cap_gib)  # fmt: skip
    cases = [(m, meth, p, False) for m in args.models for p in args.precisions for meth in args.methods]
    if args.compile:
        cases += [(m, meth, "fp32", True) for m in args.models for meth in args.methods if meth in COMPILABLE]
    offloading = ("save_on_cpu", "L3")  # on a CPU there is nothing to offload to
    cases = [c for c in cases if not (c[1] in offloading and args.device == "cpu")]
    try:
        from tqdm import tqdm

        cases = tqdm(cases, desc="benchmark", unit="run")
    except ImportError:
        pass
    rows = []
    for model, method, precision, compiled in cases:
        try:
            rows.append(run_one(model, method, precision, args, compiled))
        except torch.cuda.OutOfMemoryError:
            label = method + ("+bf16" if precision == "bf16" else "") + ("+compile" if compiled else "")
            rows.append({"model": model, "method": label, "note": "OOM"})
    compare(rows)
    out = args.folder
    if args.merge:
        rows = _merged(out, rows, env)
    table = render(rows, env)
    bench.write(out, env, rows, table)
    if args.sweep:
        plot(rows, out / "batch_throughput.png", env)
    print(table)
    print(where(out))
    return rows


if __name__ == "__main__":
    run()
