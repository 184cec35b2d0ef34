"""Later adaptations' allocations against measuring each tensor on its own: what the later estimates' shortcuts cost.

    python -m benchmarks.later                  # the models below, each tensor alone against the estimator as it is
    python -m benchmarks.later --update-results # the same, into the committed results
    python -m benchmarks.later --quick          # the zoo ResNet, one seed, three later adaptations

A later estimate measures some tensors together and scales each by what their pass measured over what they were
expected to put (gactx/controller/adaptation/passes.py: the negligible ones, and up to ``ROTATIONS / (ROTATIONS + 1)``
of those no group takes). Each model trains at L2.2: a first adaptation, then ``--later`` rounds of ``--steps`` SGD
steps (learning rate 0.01), each followed by a later adaptation; the gradient error of the allocation each later
adaptation but the first makes (which follows the first adaptation and rotates nothing) is the mean over ``--draws``
gradients of ``||g - g_exact||^2 / ||g_exact||^2`` on the training batch. Arms, in turn on the same seeds: ``alone``
(``passes.ROTATE`` off: no tensor rotated) and ``as is`` (the defaults). The benchmark workloads adapt on their probe
sub-batch (``benchmarks.methods.sub_batch``), the zoo models on their batch.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

import gactx
from benchmarks.harness import Bench, where
from benchmarks.methods import sub_batch
from benchmarks.schemes import drawn_errors, gradient
from benchmarks.table import markdown_table
from gactx.controller.adaptation import passes

MODELS = (
    "resnet50", "bert-base", "vit-b16", "llama-lora", "zoo:transformer_layer", "zoo:bert", "zoo:gat", "zoo:resnet",
)  # fmt: skip
SEEDS = {"resnet50": 2, "bert-base": 2, "vit-b16": 1, "llama-lora": 1}  # the zoo's: 3
ARMS = {"alone": False, "as is": True}  # passes.ROTATE


def _model(name: str) -> tuple[torch.nn.Module, Callable[[], torch.Tensor], Callable[[], torch.Tensor]]:
    """``(model, training loss, the closure's loss)``: a zoo model on its batch, or a small benchmark workload whose
    closure takes its probe sub-batch."""
    if name.startswith("zoo:"):
        from benchmarks.zoo import build

        model, run = build(name[4:], 1)
        return model, run, run
    from benchmarks.workloads import build

    w = build(name, "small")
    inputs, target = w.make_batch(w.default_batch, torch.Generator().manual_seed(0))
    probe_inputs, probe_target = sub_batch(w, inputs, target)
    return w.model, lambda: w.loss(w.model, inputs, target), lambda: w.loss(w.model, probe_inputs, probe_target)


def adapt_and_train(name: str, seed: int, later: int, steps: int, draws: int) -> dict:
    """One seed of one arm (``passes.ROTATE`` as set): the errors of the later allocations, their passes and
    seconds."""
    torch.manual_seed(seed)
    model, loss, closure_loss = _model(name)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trained, lr=0.01)

    def closure() -> None:
        torch.manual_seed(0)
        closure_loss().backward()

    controller = gactx.Controller(model, "L2.2", adapt_interval=10**9, seed=seed)
    with controller:
        gradient(model, loss)
        controller.adapt(closure)
    errors, counts, seconds = [], [], []
    for k in range(later):
        for i in range(steps):
            optimizer.zero_grad()
            torch.manual_seed(100 + i)
            loss().backward()
            optimizer.step()
        with controller:
            gradient(model, loss)
            a = controller.adapt(closure)
        counts.append(a.passes)
        seconds.append(a.seconds)
        if k == 0:  # after the first adaptation, whose curves' widths leave nothing to rotate
            continue
        exact = gradient(model, loss)
        with controller:
            errors.append(statistics.mean(drawn_errors(model, loss, controller, exact, draws)))
    return {"errors": errors, "passes": counts, "seconds": seconds}


def measure(name: str, seeds: int, later: int, steps: int, draws: int) -> list[dict]:
    """Both arms of one model, the same seeds each: a row an arm."""
    rows = []
    for arm, rotate in ARMS.items():
        before = passes.ROTATE
        passes.ROTATE = rotate
        start = time.perf_counter()
        try:
            runs = [adapt_and_train(name, seed, later, steps, draws) for seed in range(seeds)]
        finally:
            passes.ROTATE = before
        errors = [e for r in runs for e in r["errors"]]
        counts, spent = [p for r in runs for p in r["passes"]], sum(s for r in runs for s in r["seconds"])
        rows.append({
            "model": name, "arm": arm, "seeds": seeds, "error": statistics.mean(errors), "errors": errors,
            "passes": counts, "adaptation_s": spent, "seconds": round(time.perf_counter() - start, 1),
        })  # fmt: skip
    alone = rows[0]["error"]
    for row in rows:
        row["ratio"] = row["error"] / alone if alone > 0 else float("nan")
    return rows


def render(rows: list[dict], env: dict) -> str:
    lines = [
        "# gactx later adaptations against each tensor measured alone",
        "",
        f"- {env['device_name']}; torch {env['torch']}; run {env['date']}; level L2.2; {env['procedure']}",
        "- error: the mean over seeds and the later allocations (but the first) of ||g - g_exact||^2 / ||g_exact||^2;"
        " ratio: against the arm `alone` (no tensor rotated) on the same seeds",
        "",
    ]
    table = [
        [r["model"], r["arm"], r["seeds"], f"{r['error']:.4g}", f"{r['ratio']:.3f}", sum(r["passes"]),
         f"{r['adaptation_s']:.2f}"]
        for r in rows
    ]  # fmt: skip
    header = ["model", "arm", "seeds", "gradient error", "ratio", "passes (all later)", "their seconds"]
    return "\n".join(lines + markdown_table(header, table, left=2)) + "\n"


def run(argv: list[str] | None = None) -> list[dict]:
    bench = Bench("later", __doc__, quick="the zoo ResNet, one seed, three later adaptations")
    parser = bench.parser
    parser.add_argument("--models", nargs="+", help="models (zoo:NAME or a benchmark workload); default: all")
    parser.add_argument("--later", type=int, default=5, help="later adaptations, each after --steps SGD steps")
    parser.add_argument("--steps", type=int, default=10, help="SGD steps before each later adaptation")
    parser.add_argument("--draws", type=int, default=4, help="gradients drawn at each allocation")
    args = bench.parse(argv)
    torch.set_num_threads(2)
    models = ["zoo:resnet"] if args.quick else (args.models or list(MODELS))
    later = 3 if args.quick else args.later
    procedure = f"{later} later adaptations, each after {args.steps} SGD steps (lr 0.01); {args.draws} draws each"
    env = bench.environment("cpu", procedure=procedure)
    rows = []
    for name in models:
        print(f"{name} ...", flush=True)
        rows += measure(name, 1 if args.quick else SEEDS.get(name, 3), later, args.steps, args.draws)
    table = render(rows, env)
    print(table)
    folder = bench.folder(args, "cpu")
    bench.write(folder, env, rows, table)
    print(where(folder))
    return rows


if __name__ == "__main__":
    run()
