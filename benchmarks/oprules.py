"""What the op rules buy and cost: FewBit codes against quantized inputs, and the op watcher's time.

    python -m benchmarks.oprules             # both parts, results under benchmarks/runs/cpu/ (git-ignored)
    python -m benchmarks.oprules --update-results   # the same, into the committed benchmarks/results/cpu/
    python -m benchmarks.oprules --quick     # fewer draws and steps, to check that it runs

1. Gradient error of smooth activations (GELU, SiLU, tanh) at 2, 3 and 4 bits: the input of the op is
   stored either as FewBit codes (deterministic, the derivative's optimal levels) or quantized per group of
   256 with stochastic rounding, as the linear class is (3 bits is computed, not stored: gactx packs 1, 2, 4
   and 8). The error is ``||g' - g|| / ||g||`` for ``g = grad_out * f'(x)``, ``x ~ N(0, sigma^2)``, unit
   upstream gradients, the mean over draws of the noise.
2. Softmax backward from attention probabilities quantized at 2, 4 and 8 bits: the error of one draw and
   the bias left in the mean of many (the attention class's narrowest width).
3. The watcher: the host time it adds to one aten op, and forward passes of the models benchmark's small
   models watched every time (``op_rules="always"``) against applying what the first pass learned
   (``"learn"``), alternated in one process, medians.

Writes oprules.json, oprules.md and oprules.csv.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from benchmarks import workloads
from benchmarks.harness import Bench, where
from benchmarks.table import markdown_table
from gactx import Controller
from gactx.kernels.fewbit import FUNCTIONS, SAVES_RESULT, fewbit_table

FUNCTIONS_MEASURED = ("gelu", "silu", "tanh")
WIDTHS = (2, 3, 4)
SIGMAS = (1.0, 3.0)
MODELS = ("bert-base", "resnet50", "gat")


def _quantized(x: torch.Tensor, bits: int, gen: torch.Generator, group: int = 256) -> torch.Tensor:
    """Per-group min/max stochastic rounding at any width (the linear class's arithmetic, in float64)."""
    g = x.reshape(-1, group)
    lo, hi = g.amin(1, keepdim=True), g.amax(1, keepdim=True)
    step = (hi - lo).clamp_min(1e-30) / ((1 << bits) - 1)
    q = torch.floor((g - lo) / step + torch.rand(g.shape, generator=gen, dtype=g.dtype))
    return (q.clamp(0, (1 << bits) - 1) * step + lo).reshape(x.shape)


def _derivative(name: str, x: torch.Tensor) -> torch.Tensor:
    x = x.detach().requires_grad_()
    FUNCTIONS[name](x).sum().backward()
    return x.grad


def _fewbit(name: str, x: torch.Tensor, bits: int) -> torch.Tensor:
    """The derivative the op's backward computes from a FewBit code of what it saves."""
    table = fewbit_table(name, (), bits)
    saved = FUNCTIONS[name](x) if name in SAVES_RESULT else x
    code = torch.bucketize(saved, torch.tensor(table.edges, dtype=x.dtype))
    return torch.tensor(table.levels, dtype=x.dtype)[code]


def gradient_errors(draws: int) -> list[dict]:
    rows = []
    for name in FUNCTIONS_MEASURED:
        for sigma in SIGMAS:
            gen = torch.Generator().manual_seed(0)
            x = sigma * torch.randn(1 << 16, generator=gen, dtype=torch.float64)
            grad_out = torch.randn(x.shape, generator=gen, dtype=torch.float64)
            exact = grad_out * _derivative(name, x)
            for bits in WIDTHS:
                fewbit = grad_out * _fewbit(name, x, bits)
                errors = []
                for _ in range(draws):
                    saved = FUNCTIONS[name](x) if name in SAVES_RESULT else x
                    stored = _quantized(saved, bits, gen)
                    if name in SAVES_RESULT:  # the backward of tanh reads its result: 1 - y^2
                        d = 1 - stored**2
                    else:
                        d = _derivative(name, stored)
                    errors.append(float((grad_out * d - exact).norm() / exact.norm()))
                rows.append({
                    "function": name, "sigma": sigma, "bits": bits,
                    "fewbit_error": float((fewbit - exact).norm() / exact.norm()),
                    "quantized_error": float(np.mean(errors)),
                })  # fmt: skip
    return rows


def attention_widths(draws: int) -> list[dict]:
    """Softmax backward from attention probabilities stored quantized (the linear class's arithmetic) at 2, 4
    and 8 bits: relative error of one draw, and the cosine of the mean of the draws with the exact gradient
    (what is left of it is bias: the backward ``y * (g - sum(g * y))`` is quadratic in ``y``)."""
    rows = []
    for scale in (1.0, 4.0):  # logits' spread: flat and peaked attention
        gen = torch.Generator().manual_seed(0)
        y = torch.softmax(scale * torch.randn(256, 128, generator=gen, dtype=torch.float64), dim=-1)
        g = torch.randn(y.shape, generator=gen, dtype=torch.float64)

        def backward(p, g=g):
            return p * (g - (g * p).sum(-1, keepdim=True))

        exact = backward(y)
        for bits in (2, 4, 8):
            grads = [backward(_quantized(y, bits, gen)) for _ in range(draws)]
            mean = torch.stack(grads).mean(0)
            error = float(np.mean([float((d - exact).norm() / exact.norm()) for d in grads]))
            rows.append({
                "logit_scale": scale, "bits": bits, "error_one_draw": error,
                "cosine_of_mean": float(torch.nn.functional.cosine_similarity(mean.flatten(), exact.flatten(), 0)),
                # independent noise of relative size e, averaged over n draws, leaves cosine 1/sqrt(1 + e^2/n)
                "cosine_variance_alone": 1 / (1 + error**2 / draws) ** 0.5,
            })  # fmt: skip
    return rows


def _forward(w, controller, inputs, target) -> None:
    with controller:
        w.loss(w.model, inputs, target)


def watch_us_per_op(repeats: int = 7, ops: int = 2000) -> float:
    """Host time the watcher adds to one aten op: a loop of small adds with it and without, medians."""
    from gactx.controller.watch import OpWatcher

    a, b = torch.ones(8), torch.ones(8)
    watcher = OpWatcher(lambda *_: None)

    def loop() -> float:
        start = time.perf_counter()
        for _ in range(ops):
            torch.add(a, b)
        return time.perf_counter() - start

    plain, watched = [], []
    for _ in range(repeats):
        plain.append(loop())
        with watcher:
            watched.append(loop())
    return 1e6 * (statistics.median(watched) - statistics.median(plain)) / ops


def watcher_cost(steps: int) -> list[dict]:
    """Forward passes of the small models at L1, watched every time (``always``) and with what the first
    pass learned (``learn``, not watched): the same compression either way, so the difference is watching."""
    per_op = watch_us_per_op()
    rows = []
    for name in MODELS:
        w = workloads.build(name, "small", "cpu")
        inputs, target = w.make_batch(w.default_batch, torch.Generator().manual_seed(0))
        controllers = {mode: Controller(w.model, level="L1", op_rules=mode) for mode in ("learn", "always")}
        for c in controllers.values():  # learn, warm up
            for _ in range(2):
                _forward(w, c, inputs, target)
        ops_before = controllers["always"].diagnostics()["watched_ops"]
        _forward(w, controllers["always"], inputs, target)
        ops = controllers["always"].diagnostics()["watched_ops"] - ops_before
        times = {mode: [] for mode in controllers}
        for _ in range(steps):
            for mode, c in controllers.items():  # alternated, so drift hits both alike
                start = time.perf_counter()
                _forward(w, c, inputs, target)
                times[mode].append(time.perf_counter() - start)
        learn, always = (statistics.median(times[m]) for m in ("learn", "always"))
        rows.append({
            "model": name, "aten_ops_per_forward": ops, "watch_us_per_op": round(per_op, 1),
            "forward_ms_learn": round(1e3 * learn, 2), "forward_ms_always": round(1e3 * always, 2),
            "predicted_ms": round(ops * per_op / 1e3, 2), "measured_ms": round(1e3 * (always - learn), 2),
        })  # fmt: skip
    return rows


def render(errors: list[dict], attention: list[dict], cost: list[dict], env: dict) -> str:
    lines = [
        f"# gactx op rules on {env['device_name']}",
        "",
        f"- torch {env['torch']}; run {env['date']}",
        "",
        "## FewBit codes against quantized inputs (relative gradient error)",
        "",
        f"`||g' - g|| / ||g||` for `g = grad_out * f'(x)`, `x ~ N(0, sigma^2)`, {env['draws']} noise draws for "
        "the quantized input (per group of 256, stochastic rounding; 3 bits computed, not stored).",
        "",
    ]
    lines += markdown_table(
        ("function", "sigma", "bits", "FewBit", "quantized input", "FewBit better by"),
        [
            (r["function"], f"{r['sigma']:g}", r["bits"], f"{r['fewbit_error']:.4f}", f"{r['quantized_error']:.4f}",
             f"{r['quantized_error'] / max(r['fewbit_error'], 1e-12):.1f}x")
            for r in errors
        ],
    )  # fmt: skip
    lines += [
        "",
        "## Attention probabilities: the narrowest width",
        "",
        "Softmax backward `y * (g - sum(g * y))` from probabilities (256 rows of 128) stored quantized; "
        f"{env['draws']} draws. The cosine of the draws' mean with the exact gradient shows the bias that "
        "averaging cannot remove; next to it, what independent noise of the measured size alone would leave.",
        "",
    ]
    lines += markdown_table(
        ("logit scale", "bits", "relative error, one draw", "cosine of the mean of the draws", "variance alone"),
        [
            (f"{r['logit_scale']:g}", r["bits"], f"{r['error_one_draw']:.4f}", f"{r['cosine_of_mean']:.5f}",
             f"{r['cosine_variance_alone']:.5f}")
            for r in attention
        ],
        left=0,
    )  # fmt: skip
    lines += [
        "",
        "## What knowing the op costs",
        "",
        f"Host time the watcher adds to an aten op (a loop of small adds, with and without it): "
        f"{cost[0]['watch_us_per_op']} us. Forward passes of the small models at L1 (median of {env['steps']}, "
        "alternated): `always` watches every forward, `learn` applies what its first pass learned without "
        "watching; both compress the same way, so the difference is the watching. Predicted: ops x the cost "
        "of an op.",
        "",
    ]
    lines += markdown_table(
        ("model", "aten ops a forward", "forward ms, learn", "forward ms, always", "watching, predicted ms",
         "watching, measured ms"),
        [
            (r["model"], r["aten_ops_per_forward"], r["forward_ms_learn"], r["forward_ms_always"], r["predicted_ms"],
             r["measured_ms"])
            for r in cost
        ],
    )  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    bench = Bench("oprules", __doc__, quick="fewer draws and steps")
    args = bench.parse(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    draws, steps = (4, 3) if args.quick else (32, 31)
    env = bench.environment("cpu", draws=draws, steps=steps)
    errors = gradient_errors(draws)
    attention = attention_widths(draws)
    cost = watcher_cost(steps)
    text = render(errors, attention, cost, env)
    print(text)
    # The rows: each model's gradient errors; the attention widths and the watcher's cost beside them.
    folder = bench.folder(args, "cpu")
    bench.write(folder, env, errors, text, indent=1, attention=attention, cost=cost)
    print(where(folder))


if __name__ == "__main__":
    main()
