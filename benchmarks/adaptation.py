"""What adaptive bits cost: the estimator's passes and seconds against training time at the interval.

    python -m benchmarks.adaptation                  # digits CNN and the character-level transformer
    python -m benchmarks.adaptation --update-results # the same, into the committed results
    python -m benchmarks.adaptation --quick          # a few steps each, to check that it runs

Each model trains at level L2.2 with a sub-batch closure for the estimator (16 images; 8 sequences of 64
characters; 8 samples of the benchmark workloads' ResNet-50, BERT-base and LoRA Llama-style decoder at their small
sizes, 1 sequence of the decoder's 4); one adaptation runs after the first step, and ``LATER`` later ones (one
estimate each, their seconds averaged) after training. The step time excludes the first adaptation, and the share of
training time is ``adaptation / (interval * step + adaptation)`` at the default interval (1000), and for the later
ones also at the longest interval the schedule backs off to while allocations hold (``adapt_backoff`` times the
interval: gactx/controller/adaptation/schedule.py). The schedule itself is shown on the character-level transformer
trained for 400 steps at ``adapt_interval=25``: the steps it adapted at, and its adaptations' share of that run's
time against a fixed interval's count.
Writes adaptation.json and adaptation.md under ``benchmarks/runs/<device>/`` (git-ignored), or with
``--update-results`` under ``benchmarks/results/<device>/`` (the committed results).
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from collections.abc import Callable

import torch

import gactx
from benchmarks.charlm import train_charlm
from benchmarks.digits import train_digits
from benchmarks.harness import Bench, where
from benchmarks.methods import sub_batch
from benchmarks.table import markdown_table
from benchmarks.workloads import build
from gactx.config import Config
from gactx.controller.adaptation import cost, gact_estimator

INTERVAL = Config.adapt_interval  # the default
BACKOFF = Config.adapt_backoff  # the default: the longest interval is this many times INTERVAL
SCHEDULE_STEPS, SCHEDULE_INTERVAL = 400, 25  # the run that shows the schedule


WORKLOADS = ("resnet50", "bert-base", "llama-lora")  # benchmarks/workloads.py's, at size small (--quick: tiny)
WORKLOAD_STEPS = 6  # training steps of each: the first adapts; the step time is the median of the others
# Later adaptations in a row after training, their seconds averaged: the first follows the allocation made at step 1
# (its budget for the negligible tensors is that allocation's, made on the untrained model), the next ones follow
# one made on the trained model, and measure alone what the one before measured together (passes.ROTATE). Each
# starts after a full collection of Python's garbage collector: one of the whole process (0.17 s for its 330K
# objects, with the five models' libraries loaded) otherwise fell inside the second, whichever work made it due. As many
# as one cycle of gact_estimator.RECHECK: where the checks read far below the threshold, one of them replays its first
# pass and the others leave it out, as in any such run of later adaptations.
LATER = gact_estimator.RECHECK
# Training steps timed just before each later adaptation of the benchmark workloads: the later shares are read against
# their median, this machine's speed moving within minutes (the step times of the training before are read for the
# first adaptation's share; the digits CNN and the character-level transformer's later shares too).
STEPS_BESIDE = 3


@dataclasses.dataclass
class WorkloadRun:
    seconds: float  # the training steps', the first adaptation included
    step_s: float  # the median step after the first (the op watcher's pass, and the first adaptation)
    controller: gactx.Controller
    closure: Callable[[], object]
    step: Callable[[], float] | None = None  # one more training step (hooks installed by the caller): its seconds


def train_workload(name: str, level: str | None, quick: bool) -> WorkloadRun:
    """A benchmark workload trained a few steps on one batch at ``level`` (``None``: plain PyTorch, counted by a
    controller at L0), ``iterate`` given a closure over the workload's probe sub-batch."""
    w = build(name, "tiny" if quick else "small")
    inputs, target = w.make_batch(w.default_batch, torch.Generator().manual_seed(0))
    probe_inputs, probe_target = sub_batch(w, inputs, target)
    optimizer = torch.optim.Adam([p for p in w.model.parameters() if p.requires_grad], lr=w.lr)
    controller = gactx.Controller(w.model, level=level or "L0")

    def closure() -> None:
        w.loss(w.model, probe_inputs, probe_target).backward()

    def step() -> float:
        start = time.perf_counter()
        loss = w.loss(w.model, inputs, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        controller.iterate(closure)
        return time.perf_counter() - start

    with controller:
        steps = [step() for _ in range(3 if quick else WORKLOAD_STEPS)]
    return WorkloadRun(sum(steps), statistics.median(steps[1:]), controller, closure, step)


def measure(name: str, quick: bool) -> dict:
    if name == "digits_cnn":
        full, run = train_digits(None, epochs=1 if quick else 8), train_digits("L2.2", epochs=1 if quick else 8)
    elif name in WORKLOADS:
        full, run = train_workload(name, None, quick), train_workload(name, "L2.2", quick)
    else:
        steps = 5 if quick else 150
        full, run = train_charlm(None, steps=steps), train_charlm("L2.2", steps=steps)
    a = run.controller.last_adaptation
    if isinstance(run, WorkloadRun):
        step_s, full_step_s = run.step_s, full.step_s
    else:
        step_s = (run.seconds - a.seconds) / run.controller.step
        full_step_s = full.seconds / full.controller.step
    run.controller.install_hook()
    laters, beside = [], []  # beside: training steps timed just before each later adaptation (workloads)
    try:  # adaptations after the first, on the trained model: one estimate each
        for _ in range(LATER):
            if isinstance(run, WorkloadRun) and run.step is not None:
                beside += [run.step() for _ in range(STEPS_BESIDE)]
            gc.collect()  # a collection of the whole process, which the work before may have made due, not in it
            laters.append(run.controller.adapt(run.closure))
    finally:
        run.controller.uninstall_hook()
    later_s = statistics.mean(a.seconds for a in laters)
    later = laters[-1]
    later_step_s = statistics.median(beside) if beside else step_s  # the step the later shares are read against
    return {
        "model": name,
        "tensors_measured": len(run.controller.sensitivity),
        "passes": a.passes,
        "adaptation_s": round(a.seconds, 3),
        "step_s": round(step_s, 4),
        "full_precision_step_s": round(full_step_s, 4),
        "share_at_interval": round(a.seconds / (INTERVAL * step_s + a.seconds), 4),
        "steps_one_adaptation_costs": round(a.seconds / step_s, 1),
        "later_passes": [b.passes for b in laters],
        "partial_passes": a.partial_passes,
        "later_partial_passes": later.partial_passes,
        "later_s": round(later_s, 3),
        "later_each_s": [round(b.seconds, 3) for b in laters],
        "later_step_s": round(later_step_s, 4),
        "later_share_at_interval": round(later_s / (INTERVAL * later_step_s + later_s), 4),
        "later_share_backed_off": round(later_s / (BACKOFF * INTERVAL * later_step_s + later_s), 4),
        "passes_by_part": {part: list(v) for part, v in a.passes_by_part.items()},
        "later_passes_by_part": {part: list(v) for part, v in later.passes_by_part.items()},
    }


def schedule(quick: bool) -> dict:
    """The character-level transformer trained with a short interval: when it adapted, and what that cost."""
    steps, interval = (12, 3) if quick else (SCHEDULE_STEPS, SCHEDULE_INTERVAL)
    adaptations = []
    adapt = gactx.Controller.adapt

    def recorded(controller, backprop=None):
        a = adapt(controller, backprop)
        adaptations.append(a)
        return a

    gactx.Controller.adapt = recorded
    try:
        run = train_charlm("L2.2", steps=steps, adapt_interval=interval)
    finally:
        gactx.Controller.adapt = adapt
    seconds = sum(a.seconds for a in adaptations)
    return {
        "steps": steps,
        "adapt_interval": interval,
        "adapted_at": [a.step for a in adaptations],
        "stable": [a.stable for a in adaptations],
        "fixed_interval_adaptations": 1 + steps // interval,
        "adaptation_s": round(seconds, 3),
        "run_s": round(run.seconds, 3),
        "share": round(seconds / run.seconds, 4),
    }


def render(rows: list[dict], env: dict, plan: dict) -> str:
    lines = [
        f"# gactx adaptation cost on {env['device_name']}",
        "",
        f"- torch {env['torch']}; run {env['date']}; level L2.2, default interval {INTERVAL} steps",
        "- share = adaptation / (interval x step + adaptation); step time at L2.2 without the adaptation",
        "- first: the adaptation after step 1 (the sketches' calibration and the normalisation inputs' curves "
        f"measured); later: {LATER} in a row after training, on the trained model (curves and calibrations kept), "
        "each after a full garbage collection (gc.collect()), their passes each and their mean seconds, their share "
        f"read against the median of {STEPS_BESIDE} training steps timed before each (ResNet-50, BERT-base, the "
        "decoder; the training's step for the others); backed off: "
        "at the longest "
        f"interval the schedule reaches while allocations hold ({BACKOFF} x {INTERVAL} steps)",
        "",
    ]
    lines += markdown_table(
        ("model", "tensors measured", "first: passes", "s", "share at interval", "later: passes", "s",
         "share at interval", "share backed off", "step s (L2.2)", "step s beside the later ones",
         "step s (full precision)", "steps the first costs"),
        [
            (r["model"], r["tensors_measured"], r["passes"], r["adaptation_s"], f"{r['share_at_interval']:.2%}",
             ", ".join(map(str, _listed(r["later_passes"]))), r["later_s"], f"{r['later_share_at_interval']:.2%}",
             f"{r['later_share_backed_off']:.2%}", r["step_s"], r.get("later_step_s", r["step_s"]),
             r["full_precision_step_s"],
             r["steps_one_adaptation_costs"])
            for r in rows
        ],
    )  # fmt: skip
    lines += [
        "",
        "Where the passes went (`Adaptation.passes_by_part`: passes for measurements, by part; of them, "
        "those that ran backward from the probed nodes down, `Adaptation.partial_passes`):",
        "",
    ]
    for r in rows:
        first, later = (cost.parts_text(r.get(k) or {}) for k in ("passes_by_part", "later_passes_by_part"))
        lines.append(
            f"- {r['model']}: first {r['passes']} ({first}; {r.get('partial_passes', 0)} from the probed nodes); "
            f"last later {_listed(r['later_passes'])[-1]} ({later}; {r.get('later_partial_passes', 0)} from the probed "
            "nodes)"
        )
    held = list(zip(plan["adapted_at"], plan["stable"], strict=True))
    marks = ", ".join(f"{step}{'' if kept or i == 0 else ' (moved)'}" for i, (step, kept) in enumerate(held))
    lines += [
        "",
        f"Schedule: char_transformer, {plan['steps']} steps at adapt_interval={plan['adapt_interval']} (adapt_backoff "
        f"{BACKOFF}; moved: the allocation before it was more than 10% worse): adapted at steps {marks}; "
        f"{len(plan['adapted_at'])} adaptations where a fixed interval makes "
        f"{plan['fixed_interval_adaptations']}; {plan['adaptation_s']} s of the run's {plan['run_s']} s "
        f"({plan['share']:.1%}).",
    ]
    return "\n".join(lines) + "\n"


def _listed(passes: int | list[int]) -> list[int]:
    """A row's later passes as a list (results written before several later adaptations held one number)."""
    return passes if isinstance(passes, list) else [passes]


def run(argv: list[str] | None = None) -> list[dict]:
    bench = Bench("adaptation", __doc__, quick="a few steps each")
    args = bench.parse(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    env = bench.environment(device)
    rows = [measure(name, args.quick) for name in ("digits_cnn", "char_transformer", *WORKLOADS)]
    plan = schedule(args.quick)
    table = render(rows, env, plan)
    folder = bench.folder(args, device)
    bench.write(folder, env, rows, table, schedule=plan)
    print(table)
    print(where(folder))
    return rows


if __name__ == "__main__":
    run()
