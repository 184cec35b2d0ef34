"""What adaptive bits cost: the estimator's passes and seconds against training time at the interval.

    python -m benchmarks.adaptation                  # digits CNN and the character-level transformer
    python -m benchmarks.adaptation --update-results # the same, into the committed results
    python -m benchmarks.adaptation --quick          # a few steps each, to check that it runs

Each model trains at level L2.2 with a sub-batch closure for the estimator (16 images; 8 sequences of 64
characters); one adaptation runs after the first step, and a later one (one estimate) after training. The step
time excludes the first adaptation, and the
share of training time is ``adaptation / (interval * step + adaptation)`` at the default interval (1000).
Writes adaptation.json and adaptation.md under ``benchmarks/runs/<device>/`` (git-ignored), or with
``--update-results`` under ``benchmarks/results/<device>/`` (the committed results).
"""

from __future__ import annotations

import torch

from benchmarks.charlm import train_charlm
from benchmarks.digits import train_digits
from benchmarks.harness import Bench, where
from benchmarks.table import markdown_table
from gactx.config import Config

INTERVAL = Config.adapt_interval  # the default


def measure(name: str, quick: bool) -> dict:
    if name == "digits_cnn":
        full, run = train_digits(None, epochs=1 if quick else 8), train_digits("L2.2", epochs=1 if quick else 8)
    else:
        steps = 5 if quick else 150
        full, run = train_charlm(None, steps=steps), train_charlm("L2.2", steps=steps)
    a = run.controller.last_adaptation
    step_s = (run.seconds - a.seconds) / run.controller.step
    full_step_s = full.seconds / full.controller.step
    later = run.controller.adapt(run.closure)  # an adaptation after the first, on the trained model: one estimate
    return {
        "model": name,
        "tensors_measured": len(run.controller.sensitivity),
        "passes": a.passes,
        "adaptation_s": round(a.seconds, 3),
        "step_s": round(step_s, 4),
        "full_precision_step_s": round(full_step_s, 4),
        "share_at_interval": round(a.seconds / (INTERVAL * step_s + a.seconds), 4),
        "steps_one_adaptation_costs": round(a.seconds / step_s, 1),
        "later_passes": later.passes,
        "later_s": round(later.seconds, 3),
        "later_share_at_interval": round(later.seconds / (INTERVAL * step_s + later.seconds), 4),
    }


def render(rows: list[dict], env: dict) -> str:
    lines = [
        f"# gactx adaptation cost on {env['device_name']}",
        "",
        f"- torch {env['torch']}; run {env['date']}; level L2.2, default interval {INTERVAL} steps",
        "- share = adaptation / (interval x step + adaptation); step time at L2.2 without the adaptation",
        "- first: the adaptation after step 1 (two estimates); later: one after training, on the trained model "
        "(one estimate, the normalisation inputs' curves kept)",
        "",
    ]
    lines += markdown_table(
        ("model", "tensors measured", "first: passes", "s", "share at interval", "later: passes", "s",
         "share at interval", "step s (L2.2)", "step s (full precision)", "steps the first costs"),
        [
            (r["model"], r["tensors_measured"], r["passes"], r["adaptation_s"], f"{r['share_at_interval']:.2%}",
             r["later_passes"], r["later_s"], f"{r['later_share_at_interval']:.2%}", r["step_s"],
             r["full_precision_step_s"], r["steps_one_adaptation_costs"])
            for r in rows
        ],
    )  # fmt: skip
    return "\n".join(lines) + "\n"


def run(argv: list[str] | None = None) -> list[dict]:
    bench = Bench("adaptation", __doc__, quick="a few steps each")
    args = bench.parse(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    env = bench.environment(device)
    rows = [measure(name, args.quick) for name in ("digits_cnn", "char_transformer")]
    table = render(rows, env)
    folder = bench.folder(args, device)
    bench.write(folder, env, rows, table)
    print(table)
    print(where(folder))
    return rows


if __name__ == "__main__":
    run()
