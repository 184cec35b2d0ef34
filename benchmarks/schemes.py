"""Where the ancestors' other methods win: gradient error at equal bytes, and training, for each storage choice.

    python -m benchmarks.schemes                  # the zoo and the models benchmark's small models
    python -m benchmarks.schemes --update-results # the same, into the committed results
    python -m benchmarks.schemes --quick          # two tiny models, few draws: checks that it runs

1. Gradient error at equal bytes. Each model runs at level L2.2 (an average of 2 bits a compressed element: the
   same budget for every row) with the allocator offered: uniform codes only (the default before the other
   schemes), normal-fitted levels beside them (``normal``: SmaQ's), and sketches too (``sketch``: FewBit's
   randomized linear; the default), per-sample widths beside uniform codes (``samples``: ActNN's), and all of
   them; with GACT's estimator and with ActNN's free one. One adaptation
   after the first step, then the parameter gradient of the same batch (the same dropout masks) is drawn again with
   fresh rounding noise, and compared with plain PyTorch's: ``E ||g' - g||^2 / ||g||^2``, the mean over draws. The
   estimator's own noise (one pair of probes a tensor) moves an allocation's error by tens of percent, so each row
   repeats this for several estimator seeds (``--seeds``) and reports the mean.
   ``predicted`` is the allocator's own model of that error, ``sum C_l S_l(choice)`` over ``||g||^2``. Bytes are
   gactx's accounting of what one forward pass holds (compressed and kept tensors).
2. Training: each small model of the models benchmark trains at L2.2 with uniform codes only, with the default
   choices and with every scheme offered, from the same initialisation on the same batches, once for each of
   ``--train-seeds`` controller seeds (the rounding noise and the estimator's probes), and once in full precision
   for reference; final training loss and held-out accuracy, the mean and range over the runs.

Writes schemes.json and schemes.md under ``benchmarks/runs/<device>/`` (git-ignored), or with ``--update-results``
under ``benchmarks/results/<device>/`` (the committed results); a part or row not run is kept from the folder written.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks import workloads
from benchmarks.harness import Bench, now, read_results, where
from benchmarks.table import markdown_table
from gactx import Controller
from gactx.config import ESTIMATORS
from gactx.kernels import schemes

ALL = schemes.names()
CONFIGS = {  # label -> (schemes, estimator)
    "uniform only": (("uniform",), "gact"),
    "+normal": (("uniform", "normal"), "gact"),
    "+normal +sketch (default)": (("uniform", "normal", "sketch"), "gact"),
    "+samples": (("uniform", "samples"), "gact"),
    "all schemes": (ALL, "gact"),
    "uniform, actnn": (("uniform",), "actnn"),
    "+normal (its default), actnn": (("uniform", "normal"), "actnn"),
    "all schemes, actnn": (ALL, "actnn"),
}
ZOO = ("mlp", "resnet", "transformer_layer", "bert", "gcn", "sage", "gat", "lstm", "conv3d")
WORKLOADS = ("gcn", "sage", "gat", "bert-base", "vit-b16", "resnet50")
FULL = "full precision"  # training only: the reference without gactx
TRAIN_CONFIGS = (FULL, "uniform only", "+normal +sketch (default)", "all schemes")
BASE = "uniform only"


def _model(name: str, size: str = "small") -> tuple[torch.nn.Module, Callable[[], torch.Tensor], Callable | None]:
    """``(model, loss closure, workload)`` of a zoo model (``zoo:NAME``) or a small model of the models benchmark."""
    if name.startswith("zoo:"):
        from benchmarks.zoo import build

        model, run = build(name[4:], 1)
        return model, run, None
    w = workloads.build(name, size)
    inputs, target = w.make_batch(w.default_batch, torch.Generator().manual_seed(0))
    return w.model, lambda: w.loss(w.model, inputs, target), w


def gradient(model: torch.nn.Module, run: Callable[[], torch.Tensor], seed: int = 0) -> torch.Tensor:
    """The parameters' gradients of one pass of the loss ``run``, flat in float64, from the RNG seed ``seed``."""
    torch.manual_seed(seed)  # the same dropout masks in every pass
    for p in model.parameters():
        p.grad = None
    run().backward()
    return torch.cat([p.grad.reshape(-1).double() for p in model.parameters() if p.grad is not None])


def drawn_errors(model: torch.nn.Module, run: Callable[[], torch.Tensor], controller, exact, draws: int) -> list:
    """``||g - exact||^2 / ||exact||^2`` of ``draws`` gradients of ``run`` under ``controller`` (its hooks installed),
    each with new rounding noise: the seeds follow the controller's step."""
    norm = float(exact.square().sum())
    errors = []
    for _ in range(draws):
        controller.step += 1
        errors.append(float((gradient(model, run) - exact).square().sum()) / norm)
    return errors


def gradient_error(name: str, label: str, draws: int, size: str = "small", seeds: int = 3) -> dict:
    """One row: for each estimator seed (the probes' noise, and so the allocation), one adaptation and ``draws``
    gradients; the error is the mean over seeds of each seed's mean over its draws."""
    schemes, estimator = CONFIGS[label]
    model, run, _ = _model(name, size)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    exact = gradient(model, run)
    norm = float(exact.square().sum())
    per_seed, predicted, adapt_s, chosen = [], [], [], collections.Counter()
    for seed in range(seeds):
        controller = Controller(
            model, "L2.2", schemes=schemes, estimator=estimator, adapt_interval=10**9, seed=seed
        )  # fmt: skip
        with controller:
            gradient(model, run)
            start = time.perf_counter()
            controller.iterate(lambda: gradient(model, run))
            adapt_s.append(time.perf_counter() - start)
            errors = drawn_errors(model, run, controller, exact, draws)
            stats = controller.memory_stats()
            chosen.update(c.scheme for c in controller.plan.choices.values())
            a = controller.last_adaptation
        model.load_state_dict(state)
        per_seed.append(statistics.mean(errors))
        if a is not None:
            predicted.append(a.predicted_variance / norm)
    return {
        "model": name,
        "config": label,
        "relative_error": statistics.mean(per_seed),
        "per_seed": per_seed,
        "predicted": statistics.mean(predicted) if predicted else None,
        "packed_bytes": stats.packed_bytes,
        "original_bytes": stats.original_bytes,
        "allocated_bytes": a.allocated_bytes if a is not None else None,
        "budget_bytes": a.budget_bytes if a is not None else None,
        "tensors": len(controller.allocation),
        "chosen": {k: v / seeds for k, v in chosen.items()},
        "adaptation_s": statistics.median(adapt_s),
    }


def train(name: str, label: str, steps: int, size: str = "small", seeds: int = 3) -> dict:
    """One row: the model trains ``steps`` steps from the same initialisation on the same batches (the same
    dropout masks) once for each controller seed (the rounding noise and the estimator's probes); ``FULL``
    trains once, without gactx."""
    losses, accuracies, chosen = [], [], collections.Counter()
    for seed in range(1 if label == FULL else seeds):
        loss, accuracy, choices = _train_once(name, label, steps, size, seed)
        losses.append(loss)
        accuracies.append(accuracy)
        chosen.update(choices)
    runs = len(losses)
    return {
        "model": name,
        "config": label,
        "steps": steps,
        "seeds": runs,
        "final_loss": statistics.mean(losses),
        "per_seed_loss": losses,
        "accuracy": statistics.mean(accuracies),
        "per_seed_accuracy": accuracies,
        "chosen": {k: v / runs for k, v in chosen.items()},
    }


def _train_once(name: str, label: str, steps: int, size: str, seed: int) -> tuple[float, float, collections.Counter]:
    """Final training loss (the mean of the last five steps), held-out accuracy and the storage choices made."""
    w = workloads.build(name, size, seed=0)
    gen = torch.Generator().manual_seed(1)
    optimizer = torch.optim.Adam(w.model.parameters(), lr=w.lr)
    controller = None
    if label != FULL:
        schemes, estimator = CONFIGS[label]
        controller = Controller(w.model, "L2.2", schemes=schemes, estimator=estimator, seed=seed)
    losses = []
    with controller or contextlib.nullcontext():
        for step in range(steps):
            inputs, target = w.make_batch(w.default_batch, gen)
            torch.manual_seed(step)

            def backprop(inputs=inputs, target=target):
                loss = w.loss(w.model, inputs, target)
                optimizer.zero_grad()
                loss.backward()
                return loss

            losses.append(float(backprop().detach()))
            optimizer.step()
            if controller is not None:
                controller.iterate(backprop)
    chosen = collections.Counter(c.scheme for c in controller.plan.choices.values()) if controller else {}
    held_out = w.make_batch(w.default_batch, torch.Generator().manual_seed(12345))
    final = losses[-5:]
    return sum(final) / len(final), workloads.accuracy(w, *held_out), collections.Counter(chosen)


def _order(row: dict) -> tuple[int, int]:
    """A row's place in the table: by model, then by choices as CONFIGS lists them."""
    models = [f"zoo:{n}" for n in ZOO] + list(WORKLOADS)
    return models.index(row["model"]) if row["model"] in models else len(models), list(CONFIGS).index(row["config"])


def _chosen(c: dict) -> str:
    return ", ".join(f"{k} {v:.3g}" for k, v in sorted(c.items())) or "-"


def _spread(r: dict) -> str:
    seeds = r.get("per_seed")
    if not seeds or len(seeds) < 2:
        return ""
    return f"{min(seeds) / r['relative_error']:.2f}-{max(seeds) / r['relative_error']:.2f}"


def _range(values: list[float] | None, spec: str) -> str:
    return f"{min(values):{spec}}-{max(values):{spec}}" if values and len(values) > 1 else ""


def render(errors: list[dict], training: list[dict], env: dict) -> str:
    lines = [
        f"# gactx storage choices on {env['device_name']}",
        "",
        f"- torch {env['torch']}; gradient error run {env.get('errors_date', env['date'])}, training run "
        f"{env.get('training_date', env['date'])}; level L2.2 (2 bits a compressed element on average)",
        "- error = E ||g' - g||^2 / ||g||^2 over draws of the rounding noise (one batch, the same dropout masks),",
        f"  the mean over {env['seeds']} estimator seeds (each its own probes and allocation), "
        f"{env['draws']} draws each;",
        "  seeds = the lowest and highest seed's error over the row's mean; predicted = the allocator's model of it;",
        "  allocated / budget = the bytes the allocation holds for the tensors it allocates over the budget for them",
        "  (the same for every row of a model); bytes = gactx's accounting of everything one forward pass holds",
        "- chosen = tensors stored under each scheme other than uniform codes (the mean over seeds)",
        *([f"- {env['note']}"] if env.get("note") else []),
        "",
        "## Gradient error at equal bytes",
        "",
    ]
    base = {r["model"]: r for r in errors if r["config"] == BASE}
    lines += markdown_table(
        ("model", "choices offered", "estimator", "error", "vs uniform only", "seeds", "predicted",
         "allocated / budget", "bytes", "chosen"),
        [
            (r["model"], r["config"].split(",")[0], CONFIGS[r["config"]][1], f"{r['relative_error']:.3g}",
             f"{r['relative_error'] / base[r['model']]['relative_error']:.2f}x" if r["model"] in base else "",
             _spread(r),
             "" if r["predicted"] is None else f"{r['predicted']:.3g}",
             f"{r['allocated_bytes'] / r['budget_bytes']:.3f}" if r["budget_bytes"] else "",
             f"{r['packed_bytes']:,}", _chosen(r["chosen"]))
            for r in errors
        ],
        left=3,
    )  # fmt: skip
    if training:
        lines += ["", "## Training at L2.2", ""]
        lines += [
            f"- the mean over the row's runs: {env.get('train_seeds', 1)} controller seeds (rounding noise and probes) "
            "from the same initialisation on the same batches; full precision trains once (it has no noise); "
            "range = the lowest and highest run",
            "",
        ]
        lines += markdown_table(
            ("model", "choices offered", "steps", "runs", "final loss", "range", "held-out accuracy", "range",
             "chosen"),
            [
                (r["model"], r["config"], r["steps"], r.get("seeds", 1), f"{r['final_loss']:.4f}",
                 _range(r.get("per_seed_loss"), ".4f"), f"{r['accuracy']:.3f}",
                 _range(r.get("per_seed_accuracy"), ".3f"), _chosen(r["chosen"]))
                for r in training
            ],
            left=2,
        )  # fmt: skip
    return "\n".join(lines) + "\n"


def _provenance(args: argparse.Namespace, old: dict, now: str, partial: bool) -> dict:
    """When each part's rows were measured (a part not run keeps its rows and their date; a run of some models or
    choices adds its own), and the note on the kept rows' provenance (written by hand) while any are kept."""
    errors, training = old.get("errors_date", old.get("date", "")), old.get("training_date", old.get("date", ""))
    if "errors" in args.parts:
        rows = ", ".join((args.models or []) + (args.configs or []))
        errors = f"{errors}; rows of {rows} {now}" if partial else now
    if "training" in args.parts:
        training = now
    kept = partial or set(args.parts) != {"errors", "training"}
    return {
        "errors_date": errors,
        "training_date": training,
        **({"note": old["note"]} if kept and "note" in old else {}),
    }


def run(argv: list[str] | None = None) -> dict:
    bench = Bench("schemes", __doc__, quick="two models, few draws")
    parser = bench.parser
    parser.add_argument("--draws", type=int, default=4, help="gradient draws a seed")
    parser.add_argument("--seeds", type=int, default=3, help="estimator seeds a row (each its own allocation)")
    parser.add_argument("--steps", type=int, default=40, help="training steps a model")
    parser.add_argument("--train-seeds", type=int, default=3, help="controller seeds a training row")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument(
        "--parts", nargs="+", choices=("errors", "training"), default=["errors", "training"],
        help="what to run; a part not run keeps its rows from the results folder's schemes.json, if any",
    )  # fmt: skip
    parser.add_argument(
        "--models", nargs="+", metavar="NAME",
        help="the models to measure (zoo:NAME or a models-benchmark name); the others keep their rows from the results",
    )  # fmt: skip
    parser.add_argument(
        "--configs", nargs="+", choices=tuple(CONFIGS), metavar="LABEL",
        help=f"the choices whose error rows to measure, of {', '.join(map(repr, CONFIGS))}; the others keep theirs",
    )  # fmt: skip
    args = bench.parse(argv)
    torch.set_num_threads(args.threads)
    size = "tiny" if args.quick else "small"
    models = ["zoo:mlp", "gcn"] if args.quick else [f"zoo:{n}" for n in ZOO] + list(WORKLOADS)
    models = [m for m in models if args.models is None or m in args.models]
    configs = [c for c in CONFIGS if CONFIGS[c][1] in ESTIMATORS and (args.configs is None or c in args.configs)]
    if args.quick:
        configs = [c for c in (BASE, "all schemes") if args.configs is None or c in args.configs]
    draws = 2 if args.quick else args.draws
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = bench.folder(args, device)
    previous = read_results(out, "schemes") or {}
    old_env = previous.get("environment", previous.get("env", {}))  # "env": written before the harness
    partial = args.models is not None or args.configs is not None
    date = now()
    env = bench.environment(
        device,
        seeds=(1 if args.quick else args.seeds) if "errors" in args.parts else old_env.get("seeds", args.seeds),
        draws=draws if "errors" in args.parts else old_env.get("draws", draws),
        train_seeds=(1 if args.quick else args.train_seeds)
        if "training" in args.parts
        else old_env.get("train_seeds", 1),
        **_provenance(args, old_env, date, partial),
    )
    # A run of some models or some choices measures their rows again, in their places; the others stay.
    kept_errors = previous.get("rows", previous.get("gradient_error", []))
    errors = kept_errors if "errors" not in args.parts or partial else []
    training = [] if "training" in args.parts else previous.get("training", [])

    def save() -> dict:  # after every row: a run cut short leaves what it measured
        bench.write(out, env, errors, render(errors, training, env), indent=1, training=training)
        return {"environment": env, "rows": errors, "training": training}

    for name in models if "errors" in args.parts else []:
        for label in configs:
            r = gradient_error(name, label, draws, size, 1 if args.quick else args.seeds)
            errors[:] = sorted([e for e in errors if (e["model"], e["config"]) != (name, label)] + [r], key=_order)
            print(f"{name:24s} {label:22s} error {r['relative_error']:.4g} bytes {r['packed_bytes']:,} "
                  f"{_chosen(r['chosen'])}", flush=True)  # fmt: skip
            save()
    for name in (["gcn"] if args.quick else WORKLOADS) if "training" in args.parts else []:
        for label in [FULL, BASE, "all schemes"] if args.quick else TRAIN_CONFIGS:
            training.append(train(name, label, 3 if args.quick else args.steps, size, env["train_seeds"]))
            r = training[-1]
            print(f"train {name:18s} {label:22s} loss {r['final_loss']:.4f} accuracy {r['accuracy']:.3f}", flush=True)
            save()
    result = save()
    print(where(out))
    return result


if __name__ == "__main__":
    run()
