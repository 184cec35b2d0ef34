"""The demo: train small GNN, transformer and CNN models with and without gactx on the default device, and
print what was saved and the loss reached.

    python -m benchmarks.demo            # about 70 s on a 2-core CPU; the same models at full size:
    python -m benchmarks.demo --compile  # BERT also under torch.compile (the default on a GPU; a minute more on a CPU)
    python -m benchmarks.run             # the benchmark (see --help)

Models (generated data, nothing downloaded): GraphSAGE on a random graph shaped like ogbn-arxiv, BERT, ResNet-50
and a Llama-style decoder fine-tuned with LoRA (``benchmarks/llm.py``), each scaled down ("small") on a CPU and at
full size on a GPU. Methods: full precision, gactx L1 (4 bits) and L2.2 (adaptive, 2 bits on average); the LLM with
full precision, L1, Hugging Face's gradient checkpointing, and checkpointing with L1; on a GPU, or with ``--compile``,
BERT also with its forward under ``torch.compile`` (``+compile``: full precision and L1, compressed inside the compiled
graphs). On a CPU those rows are left out by default: Inductor's compiles of them took 49 of the demo's 165 s on 2
cores, more with cold caches, and `make demo` is meant to finish in under 3 minutes from a new machine.
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import torch

from benchmarks.device import device_name
from benchmarks.harness import summary
from benchmarks.run import alternated_step_ms, compare, run_one, variant

MODELS = ("sage", "bert-base", "resnet50", "llama-lora")
METHODS = ("fp", "L1", "L2.2")
# The LLM the way it is fine-tuned: LoRA, with and without Hugging Face's gradient checkpointing (gactx compresses the
# checkpointed layers' inputs and what their recomputation saves). Its adaptive level is left out: its first
# adaptation costs a minute here.
MODEL_METHODS = {"llama-lora": ("fp", "L1", "checkpoint", "checkpoint+L1")}
COMPILED = ("bert-base", ("fp", "L1"))  # a model and the methods also run compiled
# Models trained half the steps, and timed in 3 rounds instead of 5: the LLM's loss moves little in a few steps at this
# size (4.94 to 4.93 in 30); its rows show memory and step time, and its 4 methods at 30 steps were half the demo's time
# on a 2-core CPU.
HALF_STEPS = ("llama-lora",)


def main(argv: list[str] | None = None) -> list[dict]:
    cuda = torch.cuda.is_available()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    parser = argparse.ArgumentParser(description=summary(__doc__))
    parser.add_argument(
        "--steps", type=int, default=30, help="training steps per model and method (the LLM's: half as many)"
    )
    parser.add_argument("--size", choices=("full", "small", "tiny"), default="full" if cuda else "small")
    parser.add_argument("--models", nargs="+", choices=MODELS, help="the models to train (default: all of them)")
    parser.add_argument(
        "--threads", type=int, default=cores,
        help=f"torch threads; default: the cores this process may use ({cores}). Fewer if the machine is busy: "
        "on a 2-core machine that runs something else, two threads wait on each other",
    )  # fmt: skip
    parser.add_argument(
        "--compile", action=argparse.BooleanOptionalAction, default=cuda,
        help="also train BERT under torch.compile (default: on a GPU; on a CPU its compiles take about a minute)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.steps < 3 or args.threads < 1:
        parser.error("--steps must be at least 3 and --threads at least 1")
    torch.set_num_threads(args.threads)
    # transformers 5 renames its gradient checkpointing methods and warns, from inside peft too, at every call
    warnings.filterwarnings("ignore", message=".*will be removed in v6", category=FutureWarning)
    device = "cuda" if cuda else "cpu"
    run_args = argparse.Namespace(
        size=args.size, device=device, batch=None, train_steps=args.steps, warmup=2, timed=5,
        max_batch=False, sweep=False,
    )  # fmt: skip
    threads = "" if device == "cpu" else f", {torch.get_num_threads()} torch threads"  # a CPU's name says them
    print(f"gactx demo on {device_name(device)}, torch {torch.__version__}{threads}")
    half = max(3, args.steps // 2)  # the steps of HALF_STEPS models
    print(
        f"{args.steps} training steps a model and method ({half} the LLM's), size {args.size}; "
        + _expected(cuda, args.size)
    )
    memory = "CUDA allocator" if cuda else "saved-tensor accounting (plain PyTorch: a hook's count)"
    print(f"activations: bytes held between forward and backward, from the {memory}")
    print("peak: the most allocated at once during forward and backward, above the start (gactx.PeakMemory)")
    step = "median time of a training step, a model's methods timed in turns (5 rounds of 2 steps each, the LLM's 3)"
    print(f"step: {step}" + (
        ";\n      compiled rows 5 steps in a row (gactx's hooks off and on again would recompile the graphs)\n"
        if args.compile else "\n"))  # fmt: skip
    start = time.perf_counter()
    header = (
        f"{'model':<11}{'method':<14}{'activations':>13}{'saved':>8}{'peak':>12}{'lower':>7}{'loss':>8}{'accuracy':>10}"
        f"{'step':>10}"
    )
    print(header)
    print("-" * len(header), flush=True)
    chosen = MODELS if args.models is None else args.models
    groups = [(model, MODEL_METHODS.get(model, METHODS), False) for model in MODELS if model in chosen]
    if args.compile and (args.models is None or COMPILED[0] in args.models):
        groups.append((COMPILED[0], COMPILED[1], True))
    progress = _progress(sum(len(methods) + (not compiled) for _, methods, compiled in groups))
    rows = []
    for model, methods, compiled in groups:  # a model's rows as soon as its runs end
        halved = model in HALF_STEPS
        model_args = argparse.Namespace(**{**vars(run_args), "train_steps": half if halved else args.steps})
        timed = argparse.Namespace(**{**vars(model_args), "timed": 5 if compiled else 1})
        group, trained = [], None if compiled else []
        for method in methods:
            progress.set_description(f"{model} {method}{'+compile' if compiled else ''}")
            group.append(run_one(model, method, "fp32", timed, compiled=compiled, keep=trained))
            progress.update()
        if not compiled:  # step times of the methods in turns: other load on the machine falls on each alike
            progress.set_description(f"{model} step times")
            rounds = 3 if halved else 5
            step_ms = alternated_step_ms(model, list(methods), "fp32", model_args, rounds=rounds, trained=trained)
            for row, method in zip(group, methods, strict=True):
                row["step_ms"] = step_ms[method]
                row["samples_per_s"] = row["batch"] / (step_ms[method] / 1e3)
            progress.update()
        rows += group
        compare(rows)
        for row in group:
            progress.write(_row(row, rows))
    progress.close()
    print(f"\n{time.perf_counter() - start:.0f} s in all. gactx compresses on a CPU with its C++ kernels and on a")
    print("GPU with its Triton kernels; the activation bytes are what any device would hold.")
    return rows


def _expected(cuda: bool, size: str) -> str:
    if size == "small" and not cuda:
        return "about 70 s on 2 cores, a minute more with --compile; the first time the C++ kernels compile too (40 s)"
    if size == "tiny":
        return "under a minute"
    return "minutes: full-size models" if cuda else "long: full-size models on a CPU"


class _Lines:
    """Progress where tqdm is not installed: each run's name on a line of its own."""

    def set_description(self, text: str) -> None:
        print(f"  ... {text}", flush=True)

    def update(self) -> None:
        pass

    def write(self, line: str) -> None:
        print(line, flush=True)

    def close(self) -> None:
        pass


def _progress(total: int):
    """A tqdm bar under the table (rows are written above it), or plain lines without tqdm."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _Lines()
    return tqdm(total=total, unit="run", leave=False, dynamic_ncols=True)


def _row(r: dict, rows: list[dict]) -> str:
    saved = f"{r.get('activation_ratio', 1.0):.1f}x"
    full = next(f for f in rows if f["model"] == r["model"] and f["method"] == "fp" + variant(r["method"]))
    lower = f"{full['peak_mib'] / r['peak_mib']:.1f}x"
    return (
        f"{r['model']:<11}{r['method']:<14}{r['activation_mib']:>9.2f} MiB{saved:>8}{r['peak_mib']:>8.2f} MiB"
        f"{lower:>7}{r['final_loss']:>8.3f}{r['accuracy']:>10.1%}{r['step_ms']:>8.0f}ms"
    )


if __name__ == "__main__":
    main()
