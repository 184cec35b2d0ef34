"""Training quality: whether each level trains like full precision, over several seeds.

``python -m benchmarks.quality`` trains each workload with each method from the same weights and batches, once a
seed, and reports for each method the mean and spread of the final loss (the mean of the last five steps), its
ratio to full precision's, the steps to reach a loss threshold, the accuracy on held-out samples, and the loss
curves as a plot. A seed sets the
weights, the batches, dropout and the controller's noise alike; methods differ by the method alone.

Workloads:

- ``decoder``: a Llama-style decoder (``benchmarks/llm.py``, size ``scratch``) trained from scratch in float32 on the
  generated bigram language, AdamW; long enough to pass the phase where attention sharpens;
- ``llama-lora``: the LoRA fine-tune of ``benchmarks/llm.py`` (bf16 base weights, autocast);
- ``resnet50``: the CNN with BatchNorm of ``benchmarks/workloads.py``;
- ``sage``: GraphSAGE on the generated arxiv-shaped graph.

One loss a step is a noisy reading: compare methods by their mean over seeds against the spread, never one run.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import gactx
from benchmarks import llm, workloads
from benchmarks.harness import Bench, where
from benchmarks.methods import sub_batch
from benchmarks.table import markdown_table

__all__ = ["METHODS", "SPECS", "Spec", "decoder", "final_loss", "summarise", "train"]

METHODS = ("fp", "L1", "L1.1", "L1.2", "L2.2", "L2.2-update")
# Methods that are a level with options: name -> (level, Config fields)
OPTIONS = {"L2.2-update": ("L2.2", {"objective": "update"})}
FINAL = 5  # the final loss: the mean of the last this many steps
THRESHOLD = 1.1  # steps to reach this times full precision's mean final loss
DATA_SEED = 1000  # batches come from DATA_SEED + seed: apart from the weights' stream
HELD_OUT, HELD_OUT_SEED = 4, 12345  # accuracy on this many batches' samples, drawn from their own seed


@dataclass(frozen=True)
class Spec:
    """A workload as this benchmark trains it: ``build(seed)``, steps, learning rate, bf16 autocast or not."""

    build: Callable[[int], workloads.Workload]
    steps: int
    lr: float | None = None  # None: the workload's own
    bf16: bool = False


def decoder(size: str) -> Callable[[int], workloads.Workload]:
    """``build`` of the Llama-style decoder at ``size`` (``llm.LLAMA_SIZES``) trained from scratch: every weight,
    float32."""
    return lambda seed: llm.build(size, "cpu", seed=seed, lora=False, dtype=torch.float32)


SPECS = {
    "decoder": Spec(decoder("scratch"), 150, llm.LLM_LR["scratch"]),
    "llama-lora": Spec(lambda seed: llm.build("small", "cpu", seed=seed), 60, bf16=True),
    "resnet50": Spec(lambda seed: workloads.build("resnet50", "small", seed=seed), 60),
    "sage": Spec(lambda seed: workloads.build("sage", "small", seed=seed), 60),
}
QUICK = {  # the smoke test's: the same code at tiny sizes
    "decoder": Spec(decoder("scratch-tiny"), 12, llm.LLM_LR["scratch-tiny"]),
    "llama-lora": Spec(lambda seed: llm.build("tiny", "cpu", seed=seed), 6, bf16=True),
    "resnet50": Spec(lambda seed: workloads.build("resnet50", "tiny", seed=seed), 6),
    "sage": Spec(lambda seed: workloads.build("sage", "tiny", seed=seed), 6),
}


def train(spec: Spec, method: str, seed: int, steps: int | None = None) -> tuple[list[float], int | None, float]:
    """Train ``spec``'s workload from ``seed`` with ``method`` (``"fp"``, a gactx level or one of :data:`OPTIONS`) for
    ``steps`` (default the spec's): each step's loss, the bytes gactx held for one forward pass (its own accounting;
    ``None`` for fp), and the accuracy on a held-out batch (the same for every seed and method)."""
    w = spec.build(seed)
    torch.manual_seed(seed)  # dropout's masks
    gen = torch.Generator().manual_seed(DATA_SEED + seed)
    optimizer = torch.optim.AdamW([p for p in w.model.parameters() if p.requires_grad], lr=spec.lr or w.lr)
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if spec.bf16 else contextlib.nullcontext
    level, options = OPTIONS.get(method, (method, {}))
    controller = None if method == "fp" else gactx.Controller(w.model, level, seed=seed, **options).install_hook()
    losses, held = [], None
    try:
        for _ in range(steps or spec.steps):
            inputs, target = w.make_batch(w.default_batch, gen)
            with autocast():
                loss = w.loss(w.model, inputs, target)
            loss.backward()
            if controller is not None:
                held = controller.memory_stats().packed_bytes
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
            if controller is not None:
                probe = sub_batch(w, inputs, target)

                def backprop(probe=probe):
                    with autocast():
                        probe_loss = w.loss(w.model, *probe)
                    probe_loss.backward()

                controller.iterate(backprop)
    finally:
        if controller is not None:
            controller.uninstall_hook()
    held_out = w.make_batch(w.default_batch * HELD_OUT, torch.Generator().manual_seed(HELD_OUT_SEED))
    with autocast():
        accuracy = workloads.accuracy(w, *held_out)
    return losses, held, accuracy


def final_loss(losses: list[float]) -> float:
    return sum(losses[-FINAL:]) / len(losses[-FINAL:])


def steps_to(losses: list[float], threshold: float) -> int | None:
    """The first step (1-based) whose trailing mean of ``FINAL`` losses is at most ``threshold``; None: never."""
    for i in range(len(losses)):
        window = losses[max(0, i + 1 - FINAL) : i + 1]
        if len(window) == FINAL and sum(window) / FINAL <= threshold:
            return i + 1
    return None


def summarise(runs: dict[str, list[dict]]) -> list[dict]:
    """One row a method from its runs (``{"seed", "losses", "held_bytes", "accuracy"}`` each): final losses' mean,
    spread and ratio to fp's mean; median steps to ``THRESHOLD`` times fp's mean final loss; mean held-out accuracy."""
    fp = statistics.mean(final_loss(r["losses"]) for r in runs["fp"]) if "fp" in runs else None
    rows = []
    for method, got in runs.items():
        finals = [final_loss(r["losses"]) for r in got]
        mean = statistics.mean(finals)
        reach = [steps_to(r["losses"], THRESHOLD * fp) if fp else None for r in got]
        reached = [s for s in reach if s is not None]
        held = [r["held_bytes"] for r in got if r["held_bytes"] is not None]
        rows.append({
            "method": method, "default": method == gactx.get_optimization_level(), "seeds": len(got),
            "final_mean": mean, "final_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "final_min": min(finals), "final_max": max(finals), "finals": finals,
            "vs_fp": mean / fp - 1 if fp else None,
            "steps_to_threshold": statistics.median(reached) if len(reached) == len(reach) else None,
            "reached": f"{len(reached)}/{len(reach)}",
            "held_mib": statistics.mean(held) / 2**20 if held else None,
            "accuracy": statistics.mean(r["accuracy"] for r in got),
        })  # fmt: skip
    return rows


def _table(rows: list[dict]) -> str:
    columns = [
        "workload",
        "method",
        "seeds",
        "final loss",
        "spread",
        "vs fp",
        "steps to 1.1x fp",
        "accuracy",
        "held (gactx's count)",
    ]
    lines = []
    for r in rows:
        lines.append([
            r["workload"], r["method"] + (" (default)" if r["default"] else ""), r["seeds"],
            f"{r['final_mean']:.4f}", f"{r['final_min']:.3f}-{r['final_max']:.3f}",
            "" if r["vs_fp"] is None else f"{100 * r['vs_fp']:+.1f}%",
            f"{r['steps_to_threshold']:g}" if r["steps_to_threshold"] is not None else f"reached {r['reached']}",
            f"{100 * r['accuracy']:.1f}%",
            "" if r["held_mib"] is None else f"{r['held_mib']:.2f} MiB",
        ])  # fmt: skip
    return "\n".join(markdown_table(columns, lines, left=2))


def _plot(curves: dict[str, dict[str, list[list[float]]]], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(4.2 * len(curves), 3.4), squeeze=False)
    for ax, (name, by_method) in zip(axes[0], curves.items(), strict=True):
        for method, runs in by_method.items():
            steps = range(1, len(runs[0]) + 1)
            mean = [statistics.mean(r[i] for r in runs) for i in range(len(runs[0]))]
            line = ax.plot(steps, mean, label=method, lw=1.2)[0]
            low = [min(r[i] for r in runs) for i in range(len(runs[0]))]
            high = [max(r[i] for r in runs) for i in range(len(runs[0]))]
            ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.12, lw=0)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("training loss")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle("Training loss by step: the mean over seeds, and a band from the lowest to the highest", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict]:
    bench = Bench("quality", __doc__)
    bench.parser.add_argument("--workloads", nargs="+", choices=list(SPECS), default=list(SPECS))
    bench.parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    bench.parser.add_argument("--seeds", type=int, default=4, help="seeds a method (default 4)")
    bench.parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = bench.parse(argv)
    torch.set_num_threads(args.threads)
    specs = QUICK if args.quick else SPECS
    methods = ["fp", *(m for m in args.methods if m != "fp")]  # fp first: the others are read against it
    rows, curves = [], {}
    for name in args.workloads:
        runs: dict[str, list[dict]] = {}
        for method in methods:
            for seed in range(args.seeds):
                start = time.perf_counter()
                losses, held, accuracy = train(specs[name], method, seed)
                runs.setdefault(method, []).append(
                    {"seed": seed, "losses": losses, "held_bytes": held, "accuracy": accuracy}
                )
                print(f"{name} {method} seed {seed}: final {final_loss(losses):.4f} "
                      f"({time.perf_counter() - start:.1f} s)", flush=True)  # fmt: skip
        rows += [{"workload": name, **row} for row in summarise(runs)]
        curves[name] = {m: [r["losses"] for r in got] for m, got in runs.items()}
    env = bench.environment("cpu", seeds=args.seeds, steps={n: specs[n].steps for n in args.workloads},
                            threshold=THRESHOLD, final_steps=FINAL)  # fmt: skip
    table = _table(rows)
    folder = bench.folder(args, "cpu")
    caption = f"Training quality on {env['device_name']} (torch {env['torch']}, {env['date']}), {args.seeds} seeds.\n\n"
    bench.write(folder, env, rows, caption + table + "\n", curves=curves)
    _plot(curves, folder / "quality.png")
    print(table)
    print(where(folder))
    return rows


if __name__ == "__main__":
    main()
