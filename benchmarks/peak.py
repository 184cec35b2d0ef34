"""Peak memory of a training step as the allocator sees it, with and without gactx, and next to checkpointing.

A step is forward and backward: its peak (``gactx.PeakMemory``: the CUDA allocator's peak, or on a CPU the
running sum of the profiler's allocation events) above what was allocated when it began, so every temporary
counts: the ops', the compression's. Two ways to begin, each a column: with the parameters' gradients kept
from the step before and zeroed (``zero_grad(set_to_none=False)``; backward adds into them), and with them
set to none (PyTorch's default: backward allocates them, so the peak holds a copy of the parameters' size
whatever the method). Beside it, the saved activation bytes: plain PyTorch's counted by a hook (unique
storages, parameters left out), gactx's by its own accounting (labelled so).

Models:

- ``mlp-gelu``: 8 blocks of ``Linear(1024, 1024)`` + GELU, batch 2048, float32, loss ``out.sum()``;
- ``bert-base`` and ``resnet50`` of the models benchmark (``--size``, small by default) at their default
  batch, twice and four times it, with plain PyTorch's saved activations as a share of its step peak
  stated for each (where the share is high, activations are what a step holds; where the peak is a
  weight-sized temporary, BERT's dense embedding gradient say, no activation compression lowers it).

Methods, alternated in one process (``--repeats`` rounds, medians): full precision, gactx L1.1 (8 bits), L1
(4) and L1.2 (2), and non-reentrant checkpointing of every block. Each is warmed up first (the op watcher's
first pass, the CPU kernels' build).

Compiled (a second table; ``--compiled-models``, ``mlp-gelu`` and ``bert-base`` by default, at the largest
batch of the eager table): full precision, L1.1 and L1.2 under ``torch.compile`` (Inductor) of the whole
model, and of each block (regional: ``block.forward`` compiled, the model around it eager). Each method is
compiled afresh (``torch._dynamo.reset()``); the table gives the first step's time (compilation included),
the median step time after it, the peak, and the cosine of the gradient with eager full precision's next to
the same level's eager cosine (one step each, same batch, evaluation mode: dropout off).

    python -m benchmarks.peak                      # writes benchmarks/runs/<device>/peak.{md,json,csv} (git-ignored)
    python -m benchmarks.peak --update-results     # writes the committed benchmarks/results/<device>/peak.*
    python -m benchmarks.peak --compiled-models    # the eager table only
    python -m benchmarks.peak --quick --out /tmp/peak
    python -m benchmarks.peak --models llama-lora --compiled-models --merge --update-results   # other models' rows
                                                   # kept from the committed results
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from operator import itemgetter
from pathlib import Path

import torch
from torch import nn

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gactx  # noqa: E402
from benchmarks import workloads  # noqa: E402
from benchmarks.harness import Bench, kept_rows, read_results, where  # noqa: E402
from benchmarks.measure import count_saved_bytes  # noqa: E402
from benchmarks.methods import Method  # noqa: E402
from benchmarks.table import markdown_table  # noqa: E402

MIB = 1 << 20
LEVELS = ("L1.1", "L1", "L1.2")
METHODS = ("fp", *LEVELS, "checkpoint")
SHARE = 0.8  # saved activations' share of plain PyTorch's step peak that the models' batch must reach
BATCH_FACTORS = (1, 2, 4)


class MlpGelu(nn.Module):
    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


class Case:
    """A model, its batch and its loss: ``step()`` runs one training step (gradients set to none first)."""

    def __init__(self, name: str, model: nn.Module, blocks: list, inputs: tuple, loss, batch: int) -> None:
        self.name, self.model, self.blocks, self.inputs, self.loss = name, model, blocks, inputs, loss
        self.batch = batch

    def forward(self) -> torch.Tensor:
        return self.loss(self.model, *self.inputs)

    def step(self) -> None:
        self.model.zero_grad(set_to_none=True)
        self.forward().backward()

    def plain_saved_bytes(self) -> int:
        """What plain PyTorch saves in a step (a hook's count), the step run to its end."""
        self.model.zero_grad(set_to_none=True)
        saved, loss = count_saved_bytes(self.model, self.forward)
        loss.backward()
        return saved

    def grad_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)


def mlp_case(device: torch.device, quick: bool) -> Case:
    torch.manual_seed(0)
    width, blocks, batch = (256, 4, 256) if quick else (1024, 8, 2048)
    model = MlpGelu(width, blocks).to(device)
    x = torch.randn(batch, width, device=device)
    return Case("mlp-gelu", model, list(model.blocks), (x,), lambda m, x: m(x).sum(), batch)


def workload_case(name: str, size: str, device: torch.device, batch: int) -> Case:
    w = workloads.build(name, size, device, seed=0)
    inputs, target = w.make_batch(batch, torch.Generator().manual_seed(0))
    return Case(name, w.model, w.blocks, (inputs, target), lambda m, inputs, target: w.loss(m, inputs, target), batch)


def peak_of(case: Case, device: torch.device, keep_grads: bool) -> int:
    """The peak of a forward and backward; the gradients zeroed in place (kept) or set to none before it
    (outside the region: what a step frees first would lower the running sum)."""
    if keep_grads:
        for p in case.model.parameters():
            if p.grad is None and p.requires_grad:
                p.grad = torch.zeros_like(p)
        case.model.zero_grad(set_to_none=False)
    else:
        case.model.zero_grad(set_to_none=True)
    with gactx.PeakMemory(device) as meter:
        case.forward().backward()
    return meter.peak


def saved_share(case: Case, device: torch.device) -> tuple[int, int]:
    """Plain PyTorch's saved bytes and step peak."""
    case.step()  # warm-up
    return case.plain_saved_bytes(), peak_of(case, device, keep_grads=True)


def model_cases(name: str, size: str, device: torch.device, quick: bool) -> list[tuple[Case, float]]:
    """The workload at each batch of BATCH_FACTORS, with plain PyTorch's saved share of its step peak."""
    default = workloads.build(name, size, device, seed=0).default_batch
    cases = []
    for factor in BATCH_FACTORS[:1] if quick else BATCH_FACTORS:
        case = workload_case(name, size, device, default * factor)
        saved, peak = saved_share(case, device)
        cases.append((case, saved / peak))
    return cases


class Runner:
    """One method on one case: installed, warmed up, measured, removed."""

    def __init__(self, case: Case, method: str) -> None:
        self.case, self.method = case, method

    def __enter__(self):
        case = self.case
        self.controller = None
        self.wrapper = None
        if self.method in LEVELS:
            self.controller = gactx.Controller(case.model, level=self.method).install_hook()
        elif self.method == "checkpoint":
            self.wrapper = Method("checkpoint", _Blocks(case.blocks))
        case.step()  # warm-up: the watcher's pass, the kernels' first build
        return self

    def __exit__(self, *exc):
        if self.controller is not None:
            self.controller.uninstall_hook()
        if self.wrapper is not None:
            self.wrapper.close()

    def counted_bytes(self) -> int:
        """Saved activations: gactx's own accounting, or plain PyTorch's saved storages."""
        if self.controller is not None:
            self.case.step()
            return self.controller.memory_stats().packed_bytes
        return self.case.plain_saved_bytes()


class _Blocks:
    """What ``Method("checkpoint")`` needs of a workload: its blocks."""

    def __init__(self, blocks: list) -> None:
        self.blocks = blocks
        self.model = blocks[0]


COMPILED_METHODS = ("fp", "L1.1", "L1.2")


class Compiled:
    """A case run compiled: the whole model, or each block's forward (the model around them eager)."""

    def __init__(self, case: Case, mode: str, backend: str) -> None:
        self.case, self.mode, self.backend = case, mode, backend

    def __enter__(self):
        torch._dynamo.reset()
        # Every method compiled from nothing: the first step's time is a cold compile's.
        self.caches = torch._inductor.config.patch(fx_graph_cache=False)
        self.caches.__enter__()
        case = self.case
        self.model = case.model
        if self.mode == "whole":
            case.model = torch.compile(self.model, backend=self.backend)
        else:
            for block in case.blocks:
                block.forward = torch.compile(block.forward, backend=self.backend)
        return self

    def __exit__(self, *exc):
        self.case.model = self.model
        for block in self.case.blocks:
            block.__dict__.pop("forward", None)
        self.caches.__exit__(None, None, None)
        torch._dynamo.reset()


def gradient(case: Case, model: nn.Module) -> torch.Tensor:
    """The gradient of one step of ``case`` (its model may be compiled), flattened, of ``model``'s parameters,
    in evaluation mode: no dropout, whose masks differ between eager and compiled code."""
    model.eval()
    try:
        case.step()
    finally:
        model.train()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0).item()


def compiled_rows(case: Case, device: torch.device, repeats: int, backend: str) -> list[dict]:
    model = case.model
    reference = gradient(case, model)
    rows = []
    for mode in ("whole", "regional"):
        for method in COMPILED_METHODS:
            controller = None if method == "fp" else gactx.Controller(model, level=method).install_hook()
            eager_cos = cosine(gradient(case, model), reference)
            with Compiled(case, mode, backend):
                start = time.perf_counter()
                case.step()
                first = time.perf_counter() - start
                times = []
                for _ in range(3):
                    start = time.perf_counter()
                    case.step()
                    times.append(time.perf_counter() - start)
                peak = statistics.median(peak_of(case, device, keep_grads=True) for _ in range(repeats))
                compiled_cos = cosine(gradient(case, model), reference)
                counted = controller.memory_stats().packed_bytes if controller is not None else None
            if controller is not None:
                controller.uninstall_hook()
            rows.append({
                "model": case.name, "batch": case.batch, "compile": mode, "backend": backend, "method": method,
                "peak_mib": peak / MIB,
                "first_step_s": first, "step_ms": 1e3 * statistics.median(times), "grad_cos_compiled": compiled_cos,
                "grad_cos_eager": eager_cos, "saved_mib_gactx": None if counted is None else counted / MIB,
            })  # fmt: skip
            print(
                f"{case.name:10} {mode:8} {method:5} peak {peak / MIB:8.1f} MiB, first step {first:6.1f} s, "
                f"step {rows[-1]['step_ms']:7.1f} ms, gradient cosine {compiled_cos:.5f} (eager {eager_cos:.5f})",
                flush=True,
            )
    for row in rows:
        fp = next(r for r in rows if r["compile"] == row["compile"] and r["method"] == "fp")
        row["peak_vs_fp_compiled"] = fp["peak_mib"] / row["peak_mib"]
    return rows


def run(args: argparse.Namespace) -> list[dict]:
    device = torch.device(args.device)
    mlp = mlp_case(device, args.quick)
    saved, peak = saved_share(mlp, device)
    cases = [(mlp, saved / peak)]
    for name in args.models:
        cases += model_cases(name, args.size, device, args.quick)
    rows = []
    for case, share in cases:
        peaks: dict[tuple[str, bool], list[int]] = {(m, k): [] for m in METHODS for k in (True, False)}
        counted: dict[str, int] = {}
        for _ in range(args.repeats):  # alternate the methods, round after round
            for method in METHODS:
                with Runner(case, method) as runner:
                    for keep in (True, False):
                        peaks[method, keep].append(peak_of(case, device, keep))
                    counted.setdefault(method, runner.counted_bytes())
        full = {keep: statistics.median(peaks["fp", keep]) for keep in (True, False)}
        for method in METHODS:
            kept, none = (statistics.median(peaks[method, keep]) for keep in (True, False))
            rows.append({
                "model": case.name, "batch": case.batch, "method": method, "saved_share_of_fp_peak": share,
                "peak_mib": kept / MIB, "peak_vs_fp": full[True] / kept,
                "peak_grads_none_mib": none / MIB, "peak_grads_none_vs_fp": full[False] / none,
                "grad_mib": case.grad_bytes() / MIB, "saved_mib": counted[method] / MIB,
                "saved_counted_by": "gactx" if method in LEVELS else "hook",
            })  # fmt: skip
            print(
                f"{case.name:10} {method:10} peak {kept / MIB:8.1f} MiB ({full[True] / kept:5.2f}x), "
                f"gradients set to none {none / MIB:8.1f} MiB ({full[False] / none:5.2f}x)",
                flush=True,
            )
    largest = {}
    for case, _ in cases:
        if case.name in args.compiled_models and case.batch >= largest.get(case.name, case).batch:
            largest[case.name] = case
    compiled = [row for case in largest.values() for row in compiled_rows(case, device, args.repeats, args.backend)]
    return rows, compiled


def write(result: tuple[list[dict], list[dict]], args: argparse.Namespace) -> None:
    rows, compiled = result
    out = args.folder
    bench = Bench("peak", __doc__)
    env = bench.environment(args.device, size=args.size, repeats=args.repeats, quick=args.quick,
                            cuda=args.device == "cuda", backend=args.backend)  # fmt: skip
    old = read_results(out, "peak") if args.merge else None
    if old is not None:
        model = itemgetter("model")
        kept, env["kept"] = kept_rows(old, "rows", "kept", model, set(map(model, rows)))
        kept_compiled, env["kept_compiled"] = kept_rows(
            old, "compiled", "kept_compiled", model, set(map(model, compiled))
        )
        rows, compiled = kept + rows, kept_compiled + compiled
    table = render({"environment": env, "rows": rows, "compiled": compiled})
    bench.write(out, env, rows, table, compiled=compiled)
    print(where(out))


def render(result: dict) -> str:
    """``peak.md`` from what ``peak.json`` holds."""
    env, rows, compiled = result["environment"], result["rows"], result["compiled"]
    name = env.get("device_name") or env["device"]  # results written before the harness named it "device"
    cuda = env.get("cuda", not name.startswith("CPU"))
    how = "CUDA caching allocator" if cuda else "running sum of the profiler's CPU allocation events"
    lines = [
        f"# gactx step peak memory: {name}",
        "",
        f"- torch {env['torch']}; run {env['date']}; models benchmark size {env['size']}; median of {env['repeats']}",
        f"- peak: `gactx.PeakMemory` over forward + backward, above what was allocated at its start ({how}); "
        "gradients kept from the step before (zeroed in place), or set to none (allocated by backward: the "
        "peak then holds the parameters' size in gradients, whatever the method)",
        "- saved: plain PyTorch's saved storages counted by a hook (fp, checkpoint), gactx's own accounting (levels)",
        *(f"- {model}: from the run of {date}" for model, date in env.get("kept", {}).items()),
        *(f"- {model}, compiled: from the run of {date}" for model, date in env.get("kept_compiled", {}).items()),
        "",
    ]  # fmt: skip
    headers = ["model", "batch", "saved / fp peak", "method", "peak MiB", "fp / peak", "peak MiB, grads none",
               "fp / peak, grads none", "saved MiB", "saved counted by"]  # fmt: skip
    table = [
        [r["model"], r["batch"], f"{r['saved_share_of_fp_peak']:.0%}", r["method"], f"{r['peak_mib']:.1f}",
         f"{r['peak_vs_fp']:.2f}x", f"{r['peak_grads_none_mib']:.1f}", f"{r['peak_grads_none_vs_fp']:.2f}x",
         f"{r['saved_mib']:.2f}", r["saved_counted_by"]]
        for r in rows
    ]  # fmt: skip
    lines += markdown_table(headers, table, left=4)
    if compiled:
        lines += [
            "",
            f"## Compiled ({env.get('backend', 'inductor')})",
            "",
            "- whole: `torch.compile(model)`; regional: each block's `forward` compiled, the model around it eager",
            "- first step: compilation included, every method compiled afresh; step: median of 3 after it",
            "- gradient cosine: with eager full precision's gradient on the same batch, one step in evaluation "
            "mode (no dropout); beside it the same level's eager cosine",
            "",
        ]
        headers = ["model", "batch", "compile", "method", "peak MiB", "fp / peak (compiled)", "first step s",
                   "step ms", "gradient cosine", "eager gradient cosine", "saved MiB (gactx's count)"]  # fmt: skip
        table = [
            [r["model"], r["batch"], r["compile"], r["method"], f"{r['peak_mib']:.1f}",
             f"{r['peak_vs_fp_compiled']:.2f}x", f"{r['first_step_s']:.1f}", f"{r['step_ms']:.1f}",
             f"{r['grad_cos_compiled']:.5f}", f"{r['grad_cos_eager']:.5f}",
             "" if r["saved_mib_gactx"] is None else f"{r['saved_mib_gactx']:.2f}"]
            for r in compiled
        ]  # fmt: skip
        lines += markdown_table(headers, table, left=4)
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    bench = Bench("peak", __doc__, quick="small shapes, tiny models, one round")
    p = bench.parser
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if cuda else "cpu")
    p.add_argument("--size", choices=("full", "small", "tiny"), default="full" if cuda else "small")
    p.add_argument("--models", nargs="*", default=["bert-base", "resnet50"], choices=workloads.names())
    p.add_argument("--repeats", type=int, default=3, help="rounds of every method; the median peak is kept")
    p.add_argument(
        "--compiled-models",
        nargs="*",
        default=["mlp-gelu", "bert-base"],
        choices=["mlp-gelu", *workloads.names()],
        help="models also measured under torch.compile, whole and by block, at their largest batch (none: skip)",
    )
    p.add_argument("--backend", default="inductor", help="torch.compile backend of the compiled table")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (CPU)")
    p.add_argument("--merge", action="store_true",
                   help="keep the rows of the models not run from the results in the folder written")  # fmt: skip
    args = bench.parse(argv)
    if args.quick:
        args.size, args.repeats = "tiny", 1
    args.folder = bench.folder(args, args.device)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    write(run(args), args)


if __name__ == "__main__":
    main()
