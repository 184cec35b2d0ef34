"""Two sensitivity estimators on the same batch: GACT's (about 2 + L extra passes) and ActNN's free estimate.

    python -m benchmarks.estimators                  # the zoo models and the workloads at size "small"
    python -m benchmarks.estimators --update-results # the same, into the committed results
    python -m benchmarks.estimators --quick          # tiny sizes, two models: checks that it runs

For each model with at least 4 allocated tensors, at level L2.2: GACT's estimate (``adapt(closure)``) and the
free one (``estimator="actnn"``, collected in one ordinary step of the same closure), their Spearman rank
correlation over the tensors both measured, and GACT's against itself with other probe seeds (how far its
own noise lets any estimator agree with it). Costs: GACT's seconds (a first adaptation, the median of
``GACT_REPEATS`` after one that warms up), and the free estimate's extra seconds in
its collecting step against an ordinary step (alternated in one process, the median of ``--repeats``), as a
share of that step and of training at the default interval. Writes estimators.json and estimators.md under
``benchmarks/runs/cpu/`` (git-ignored), or with ``--update-results`` under ``benchmarks/results/cpu/``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

import gactx
from benchmarks.harness import Bench, where
from benchmarks.table import markdown_table
from gactx.config import Config

INTERVAL = Config.adapt_interval  # the default
GACT_REPEATS = 3  # GACT's first adaptation timed this many times (after one that warms up): their median
LEVEL = "L2.2"
MIN_TENSORS = 4
ZOO_MODELS = ("mlp", "resnet", "transformer_layer", "bert", "gcn", "sage", "gat", "lstm", "gru", "conv3d",
              "custom_function", "inplace", "dynamic", "checkpointed")  # fmt: skip
WORKLOADS = ("gcn", "sage", "gat", "bert-base", "resnet50")


def ranks(values) -> np.ndarray:
    """Ranks from 0, ties given the mean of the ranks they span."""
    v = np.asarray(values, dtype=float)
    order = np.argsort(v, kind="mergesort")
    r = np.empty(len(v))
    r[order] = np.arange(len(v), dtype=float)
    for value in np.unique(v):
        tied = v == value
        if tied.sum() > 1:
            r[tied] = r[tied].mean()
    return r


def spearman(a, b) -> float:
    """Spearman's rank correlation (ties averaged); NaN where either side is constant."""
    ra, rb = ranks(a), ranks(b)
    if len(ra) < 2 or ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def _zoo(name: str, scale: int) -> tuple[torch.nn.Module, Callable[[], object]]:
    from benchmarks.zoo import build

    model, run = build(name, scale)
    return model, lambda: run().backward()


def _workload(name: str, size: str, batch: int | None) -> tuple[torch.nn.Module, Callable[[], object]]:
    from benchmarks.workloads import build

    w = build(name, size)
    inputs, target = w.make_batch(batch or w.default_batch, torch.Generator().manual_seed(0))
    return w.model, lambda: w.loss(w.model, inputs, target).backward()


def _seeded(backprop: Callable[[], object]) -> Callable[[], object]:
    """The closure from one RNG state every time: the same dropout masks in every pass of both estimators."""

    def run() -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            backprop()

    return run


def _gact(model, run, seed: int) -> tuple[dict, float, list]:
    controller = gactx.Controller(model, level=LEVEL, seed=seed)
    with controller:
        run()
        start = time.perf_counter()
        controller.adapt(run)
        seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return controller.sensitivity, seconds, controller.records


# Variants of the free formula (FreeCollector's switches): the default (rows paired, normalization layers'
# inputs scaled by 1/var), raw ranges at normalization layers' inputs, and one product per tensor (no rows).
VARIANTS = {"actnn": {}, "raw_norm_inputs": {"normalized": False}, "per_tensor": {"per_row": False}}


def _free(model, run, **switches) -> dict:
    controller = gactx.Controller(model, level=LEVEL, estimator="actnn")
    for name, value in switches.items():
        setattr(controller.estimator.collector, name, value)
    with controller:
        run()
        controller.iterate()  # step 1 collected; the adaptation read it
    model.zero_grad(set_to_none=True)
    return controller.sensitivity


def _free_costs(model, run, repeats: int) -> tuple[dict, float, float]:
    """The free estimate of the first step, then ordinary and collecting steps alternated: their medians."""
    controller = gactx.Controller(model, level=LEVEL, estimator="actnn", adapt_interval=1 << 30)
    ordinary, collecting = [], []
    with controller:
        run()
        controller.iterate()  # step 1 collected; the adaptation read it
        sensitivity = dict(controller.sensitivity)
        for _ in range(repeats + 1):  # the first pair warms up
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            run()
            ordinary.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
            controller.estimator.pending = True  # the next forward collects, as in the step before an adaptation
            start = time.perf_counter()
            run()
            controller.estimator.collector.take()
            collecting.append(time.perf_counter() - start)
            controller.estimator.pending = False
    model.zero_grad(set_to_none=True)
    return sensitivity, statistics.median(ordinary[1:]), statistics.median(collecting[1:])


def measure(name: str, build: Callable, repeats: int) -> dict | None:
    model, backprop = build()
    run = _seeded(backprop)
    again, _, _ = _gact(model, run, 1)  # first: it also warms up what runs once
    if len(again) < MIN_TENSORS:
        return None
    gact, gact_s, records = _gact(model, run, 0)
    seconds = [gact_s] + [_gact(model, run, 0)[1] for _ in range(GACT_REPEATS - 1)]  # the same estimate, timed again
    gact_s = statistics.median(seconds)
    free, step_s, collect_s = _free_costs(model, run, repeats)
    variants = {name: _free(model, run, **switches) for name, switches in VARIANTS.items() if switches}
    slots = [s for s in gact if s in free]
    ops = {r.key[:3]: r.op for r in records}
    extra_s = max(collect_s - step_s, 0.0)
    return {
        "model": name,
        "tensors": len(gact),
        "compared": len(slots),
        "spearman": round(spearman([gact[s] for s in slots], [free[s] for s in slots]), 3),
        "gact_self_spearman": round(spearman([gact[s] for s in gact], [again[s] for s in gact]), 3),
        **{
            f"spearman_{name}": round(spearman([gact[s] for s in slots], [v.get(s, 0.0) for s in slots]), 3)
            for name, v in variants.items()
        },
        "gact_s": round(gact_s, 4),
        "step_s": round(step_s, 4),
        "collecting_step_s": round(collect_s, 4),
        "free_extra_s": round(extra_s, 4),
        "free_extra_share_of_step": round(extra_s / step_s, 4),
        "gact_share_at_interval": round(gact_s / (INTERVAL * step_s + gact_s), 5),
        "free_share_at_interval": round(extra_s / (INTERVAL * step_s + extra_s), 6),
        "per_tensor": [
            {
                "slot": list(s),
                "op": ops.get(s, ""),
                "gact": gact[s],
                "actnn": free[s],
                **{name: v.get(s) for name, v in variants.items()},
            }
            for s in slots
        ],  # fmt: skip
    }


def pooled(rows: list[dict]) -> dict:
    """Tensor-weighted means over the models, and how many reach the bar (rank correlation >= 0.8)."""
    valid = [r for r in rows if np.isfinite(r["spearman"])]
    weight = sum(r["compared"] for r in valid) or 1
    return {
        "models": len(rows),
        "tensors": sum(r["compared"] for r in rows),
        **{
            key: round(sum(r[key] * r["compared"] for r in valid if np.isfinite(r[key])) / weight, 3)
            for key in ("spearman", "spearman_raw_norm_inputs", "spearman_per_tensor")
        },
        "gact_self_spearman": round(
            sum(r["gact_self_spearman"] * r["compared"] for r in valid if np.isfinite(r["gact_self_spearman"]))
            / weight,
            3,
        ),  # fmt: skip
        "models_at_0_8": sum(r["spearman"] >= 0.8 for r in valid),
        "free_extra_share_of_step": round(statistics.median(r["free_extra_share_of_step"] for r in rows), 4),
        "free_extra_share_of_step_max": round(max(r["free_extra_share_of_step"] for r in rows), 4),
    }


def render(rows: list[dict], pool: dict, env: dict) -> str:
    lines = [
        f"# Sensitivity estimators on {env['device_name']}",
        "",
        f"- torch {env['torch']}; run {env['date']}; level {LEVEL}; sizes: {env['sizes']}; {env['load']}",
        "- rho: Spearman rank correlation of the free estimate (ActNN's) with GACT's over the tensors both "
        "measured; GACT self: GACT's against itself with other probe seeds",
        f"- GACT s: its first adaptation, the median of {GACT_REPEATS} after one that warms up; free extra: "
        "collecting step minus an ordinary step (medians of alternated runs); shares at the default "
        f"interval ({INTERVAL} steps)",
        "",
    ]
    lines += markdown_table(
        ("model", "tensors", "rho", "rho raw norm inputs", "rho per tensor", "GACT self", "GACT s", "step s",
         "free extra s", "free extra / step", "GACT share", "free share"),
        [
            (r["model"], r["compared"], f"{r['spearman']:.3f}", f"{r['spearman_raw_norm_inputs']:.3f}",
             f"{r['spearman_per_tensor']:.3f}", f"{r['gact_self_spearman']:.3f}", r["gact_s"],
             r["step_s"], r["free_extra_s"], f"{r['free_extra_share_of_step']:.1%}",
             f"{r['gact_share_at_interval']:.3%}", f"{r['free_share_at_interval']:.4%}")
            for r in rows
        ],
    )  # fmt: skip
    lines += [
        "",
        f"Pooled over {pool['models']} models, {pool['tensors']} tensors (tensor-weighted): "
        f"rho {pool['spearman']:.3f} (raw norm inputs {pool['spearman_raw_norm_inputs']:.3f}, per tensor "
        f"{pool['spearman_per_tensor']:.3f}), GACT self {pool['gact_self_spearman']:.3f}; "
        f"{pool['models_at_0_8']} of {pool['models']} models at rho >= 0.8; "
        f"median free extra {pool['free_extra_share_of_step']:.1%} of a step, at most "
        f"{pool['free_extra_share_of_step_max']:.1%}.",
    ]
    return "\n".join(lines) + "\n"


def cases(quick: bool, size: str) -> list[tuple[str, Callable]]:
    if quick:
        return [("zoo/mlp", lambda: _zoo("mlp", 1)), ("zoo/transformer_layer", lambda: _zoo("transformer_layer", 1))]
    out = [(f"zoo/{n}", lambda n=n: _zoo(n, 1)) for n in ZOO_MODELS]
    batch = {"bert-base": 8, "resnet50": 8}
    out += [(f"{w} ({size})", lambda w=w: _workload(w, size, batch.get(w))) for w in WORKLOADS]
    return out


def _load() -> str:
    """What else ran: the 1-minute load average against the cores."""
    import os

    load = os.getloadavg()[0]
    return f"load average {load:.2f} on {os.cpu_count()} cores at the start"


def run(argv: list[str] | None = None) -> list[dict]:
    bench = Bench("estimators", __doc__, quick="two tiny models")
    parser = bench.parser
    parser.add_argument("--size", default="small", help="workloads' size (small or tiny)")
    parser.add_argument("--repeats", type=int, default=15, help="ordinary and collecting steps timed, each")
    args = bench.parse(argv)
    torch.set_num_threads(2)
    env = bench.environment("cpu", sizes=f"zoo scale 1, workloads {args.size}", load=_load())
    rows = []
    for name, build in cases(args.quick, args.size):
        print(f"{name} ...", flush=True)
        row = measure(name, build, 2 if args.quick else args.repeats)
        if row is not None:
            rows.append(row)
    pool = pooled(rows)
    table = render(rows, pool, env)
    folder = bench.folder(args, "cpu")
    bench.write(folder, env, rows, table, pooled=pool)
    print(table)
    print(where(folder))
    return rows


if __name__ == "__main__":
    run()
