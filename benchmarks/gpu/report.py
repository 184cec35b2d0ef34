"""The GPU evaluation's tables, goals and plot, from its rows: every figure beside its ratio to plain in the
same run, every table headed by the device, the versions and the date."""

from __future__ import annotations

from pathlib import Path

from benchmarks.table import markdown_table
from gactx.config import LEVELS

__all__ = ["GOALS", "goals", "render", "plot", "with_ratios"]

GIB = 1 << 30
PLAIN = "fp"
TITLES = {
    "tests": "Kernel tests on the device",
    "kernels": "Kernels at the sizes activations have",
    "llama-lora": "Llama-3.2-1B shape, LoRA r=16 on every linear layer, bf16, SDPA, sequence 4096",
    "resnet50": "ResNet-50 (torchvision), bf16 autocast, channels_last, 224 x 224, batch 256",
    "bert-large": "BERT-large (transformers, SDPA attention), bf16 autocast, sequence 128, batch 64",
    "compiled": "Compiled (torch.compile of the whole model's forward), bf16 autocast: BERT-large's shape, 6 of its 24 "
    "layers, sequence 128, batch 64",
    "host": "Host cost a saved tensor: 8 x (Linear(w, w) + GELU), batch w, float32 (benchmarks.host)",
    "adaptation": "Where an adaptation's time goes: ResNet-50 at L2.2 as in its arm, an 8-image closure",
    "baselines": "Checkpointing as users run it, and torch's offloading: BERT-large (batch 64), the LoRA Llama, bf16",
    "host-traced": "Host cost a saved tensor, L1 compiled with backend `torch` (the format in Inductor's own kernels, "
    "a tick a save): benchmarks.host's MLP",
}
LABELS = {
    "fp": "plain",
    "checkpoint": "checkpointing",  # the model's own (Hugging Face's, non-reentrant), else every block's
    "checkpoint-fast": "checkpointing, every block, no RNG state or check",
    "checkpoint-selective": "selective checkpointing (products and attention kept)",
    "save_on_cpu": "save_on_cpu (offload)",
}
# The goals the results are read against (GACT at L1: 0.73x throughput on ResNet-50, 0.90x on BERT-large;
# maximum batch 4.2x and 5.3x; full checkpointing costs about 28% more step time).
GOALS = {
    "throughput_l1": {"llama-lora": 0.90, "bert-large": 0.90, "resnet50": 0.85},
    "max_batch": {"llama-lora": 2.2, "bert-large": 5.3, "resnet50": 4.2},
    "compiled_l1": 0.90,
    "quantize_vs_clone": 0.80,  # from 4 MiB up
}


def _is_gactx(method: str) -> bool:
    """A gactx level, with checkpointing or not (not plain, not a form of checkpointing alone)."""
    return method.removeprefix("checkpoint+") in LEVELS


def label(method: str) -> str:
    return LABELS.get(method, method.replace("checkpoint+", "checkpointing + "))


def with_ratios(rows: list[dict]) -> list[dict]:
    """Training rows with their ratios to plain of the same arm, model and compilation."""
    plain = {(r["arm"], r["model"]): r for r in rows if r.get("kind") == "training" and r["method"] == PLAIN}
    out = []
    for r in rows:
        r = dict(r)
        base = plain.get((r.get("arm"), r.get("model")))
        if r.get("kind") == "training" and base is not None:
            if r.get("per_s") and base.get("per_s"):
                r["per_s_ratio"] = r["per_s"] / base["per_s"]
            if r.get("peak_bytes") and base.get("peak_bytes"):
                r["peak_ratio"] = base["peak_bytes"] / r["peak_bytes"]
            if r.get("max_batch") and base.get("max_batch"):
                r["max_batch_ratio"] = r["max_batch"] / base["max_batch"]
        out.append(r)
    return out


def _x(value: float | None, digits: int = 2) -> str:
    return "" if value is None else f"{value:.{digits}f}x"


def _num(value: float | None) -> str:
    if value is None:
        return ""
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"


def _training(rows: list[dict], arm: str) -> list[dict]:
    return [r for r in rows if r.get("kind") == "training" and r["arm"] == arm]


def goals(rows: list[dict]) -> list[tuple[str, str, str]]:
    """(goal, measured, verdict) for each goal; "not measured" where the run has no figure for it."""
    rows = with_ratios(rows)
    found = []
    for arm, floor in GOALS["throughput_l1"].items():
        l1 = next((r for r in _training(rows, arm) if r["method"] == "L1"), {})
        ratio = l1.get("per_s_ratio")
        found.append((f"{arm}: L1 throughput at least {floor:.2f}x plain's", _x(ratio), _verdict(ratio, floor)))
    for arm, floor in GOALS["max_batch"].items():
        mine = [r for r in _training(rows, arm) if _is_gactx(r["method"]) and r.get("max_batch_ratio")]
        best = max(mine, key=lambda r: r["max_batch_ratio"], default={})
        ratio = best.get("max_batch_ratio")
        shown = f"{_x(ratio)} ({label(best['method'])})" if best else ""
        found.append((f"{arm}: maximum batch at least {floor:g}x plain's", shown, _verdict(ratio, floor)))
    for arm in GOALS["max_batch"]:
        found.append(
            (f"{arm}: faster than checkpointing at the same or a lower peak", *_against_checkpointing(rows, arm))
        )
    for r in (r for r in _training(rows, "compiled") if r["method"] == "L1"):
        ratio, floor = r.get("per_s_ratio"), GOALS["compiled_l1"]  # plain's step time over L1's
        found.append(
            (f"compiled {r['model']}: L1 at least {floor:.2f}x plain's speed", _x(ratio), _verdict(ratio, floor))
        )
    kernels = [r for r in rows if r.get("kind") == "kernel" and r["size_mib"] >= 4]
    worst = min(kernels, key=lambda r: r["quantize_vs_clone"], default=None)
    floor = GOALS["quantize_vs_clone"]
    shown = (
        f"{worst['quantize_vs_clone']:.2f}x ({worst['dtype']}, {worst['bits']} bits, {worst['size_mib']:g} MiB)"
        if worst
        else ""
    )
    found.append((f"quantize at least {floor:.1f}x clone's bandwidth from 4 MiB up (the worst case)", shown,
                  _verdict(worst and worst["quantize_vs_clone"], floor)))  # fmt: skip
    return found


def _verdict(value: float | None, floor: float) -> str:
    if value is None:
        return "not measured"
    return "met" if value >= floor else "not met"


def _against_checkpointing(rows: list[dict], arm: str) -> tuple[str, str]:
    mine = _training(rows, arm)
    ckpt = next((r for r in mine if r["method"] == "checkpoint"), None)
    if ckpt is None or not ckpt.get("per_s") or not ckpt.get("peak_bytes"):
        return "", "not measured"
    gactx = [r for r in mine if _is_gactx(r["method"]) and r.get("per_s") and r.get("peak_bytes")]
    if not gactx:
        return "", "not measured"
    low = [r for r in gactx if r["peak_bytes"] <= ckpt["peak_bytes"]]
    if not low:
        lowest = min(gactx, key=lambda r: r["peak_bytes"])
        shown = (f"no gactx method reaches its peak ({_size(ckpt['peak_bytes'])}; lowest "
                 f"{label(lowest['method'])}, {_size(lowest['peak_bytes'])})")  # fmt: skip
        return shown, "not met"
    best = max(low, key=lambda r: r["per_s"])
    ratio = best["per_s"] / ckpt["per_s"]
    shown = (f"{label(best['method'])}: {ratio:.2f}x checkpointing's throughput at {_size(best['peak_bytes'])} "
             f"against {_size(ckpt['peak_bytes'])}")  # fmt: skip
    return shown, "met" if ratio > 1 else "not met"


def _bytes_unit(values) -> tuple[str, int]:
    """GiB where any of ``values`` (bytes) reaches one, else MiB (a CPU's tiny run)."""
    return ("GiB", GIB) if any(v and v >= GIB for v in values) else ("MiB", 1 << 20)


def _size(nbytes: int) -> str:
    name, scale = _bytes_unit([nbytes])
    return f"{nbytes / scale:.3g} {name}"


def _heading(env: dict) -> str:
    return (f"{env.get('device_name', '?')} · torch {env.get('torch', '?')} · triton {env.get('triton', '?')} · "
            f"{env.get('date', '?')}")  # fmt: skip


def _kernel_table(rows: list[dict]) -> list[str]:
    headers = ["dtype", "bits", "MiB", "kept", "quantize GB/s", "vs clone", "dequantize GB/s", "vs clone",
               "clone GB/s", "host us: quantize", "dequantize", "clone", "launches: quantize",
               "dequantize"]  # fmt: skip
    kernel = sorted(
        (r for r in rows if r.get("kind") == "kernel"), key=lambda r: (r["dtype"] != "fp32", r["bits"], r["size_mib"])
    )
    cells = [
        [r["dtype"], r["bits"], f"{r['size_mib']:g}", f"{100 * r['kept']:.1f}%", _num(r["quantize_gbps"]),
         _x(r["quantize_vs_clone"]), _num(r["dequantize_gbps"]), _x(r["dequantize_vs_clone"]), _num(r["clone_gbps"]),
         *(_num(r[k]) + ("*" if r.get("host_while_busy") is False else "")
           for k in ("quantize_host_us", "dequantize_host_us", "clone_host_us")),
         r["quantize_launches"] if r["quantize_launches"] is not None else "n/a",
         r["dequantize_launches"] if r["dequantize_launches"] is not None else "n/a"]
        for r in kernel
    ]  # fmt: skip
    if not cells:
        return ["(no kernel rows)"]
    lines = markdown_table(headers, cells, left=1)
    if any(r.get("host_while_busy") is False for r in kernel):
        lines.append("\n\\* the GPU went idle before the calls were queued: the host figure may hold waits for it")
    return lines


def _host_table(rows: list[dict], arm: str = "host") -> list[str]:
    mine = [r for r in rows if r.get("kind") == "host" and r.get("arm", "host") == arm]
    if not mine:
        return ["(no rows)"]
    headers = ["w", "method", "step ms", "vs plain", "us a save", "Python calls a save", "launches a save"]
    cells = [[r["width"], r["method"], _num(r["step_ms"]), _x(r["vs_plain"]), _num(r["per_save_us"]),
              _num(r["python_calls_per_save"]), _num(r.get("launches_per_save"))] for r in mine]  # fmt: skip
    return markdown_table(headers, cells, left=2) + [
        "", "Compiled methods against compiled plain; `us a save`: the step's difference to plain over its 16 "
        "compressed saves. Python calls: in the calling thread (backward's own threads are not counted)."]  # fmt: skip


def _tests_lines(rows: list[dict]) -> list[str]:
    """The kernel tests' counts under the device's torch and Triton, and what failed."""
    lines = []
    for r in (r for r in rows if r.get("kind") == "tests"):
        counts = ", ".join(f"{r.get(k, 0)} {k}" for k in ("passed", "failed", "skipped", "errors"))
        ended = (
            f"stopped at the arm's limit after {r['seconds']:.0f} s"
            if r.get("stopped_for_time")
            else (f"in {r['seconds']:.0f} s, exit {r['exit_code']}")
        )
        lines += [f"- torch {r['torch']}, triton {r['triton']}: {counts}, {ended}", f"- `{r['command']}`"]
        lines += [f"- failed: `{name}`" for name in r.get("failures", [])]
    return lines or ["Not run."]


def _adaptation_lines(rows: list[dict]) -> list[str]:
    """The ``adaptation`` arm's rows (:mod:`benchmarks.gpu.adaptation`) as lines."""
    by = {r["id"].split("/", 1)[1]: r for r in rows if r.get("kind") == "adaptation"}
    if not by:
        return ["(no rows)"]
    lines = []
    for name in ("first", "timed"):
        r = by.get(name)
        if r is not None:
            lines.append(f"- {'first' if name == 'first' else 'a later'} adaptation: {r['seconds']:.2f} s, "
                         f"{r['passes']} passes ({r['partial_passes']} from the probed nodes), "
                         f"{1e3 * r['seconds'] / max(r['passes'], 1):.1f} ms a pass")  # fmt: skip
    r = by.get("profile")
    if r is not None:
        share = r.get("device_busy_share")
        busy = f"{r['device_busy_s']:.3f} s" + ("" if share is None else f", {share:.0%} of it")
        lines.append(f"- under the profiler: {r['wall_s_profiled']:.2f} s wall, the device busy {busy}, "
                     f"{r['launches_a_pass']:.0f} launches a pass")  # fmt: skip
        for title, key in (("host", "top_host_ops"), ("device", "top_device_ops")):
            lines.append(f"- most {title} time: {_listed(r.get(key, [])) or '(none)'}")
    r = by.get("python")
    if r is not None:
        lines.append(f"- Python, most time of their own (cProfile, {r['seconds']:.2f} s): {_listed(r['top_python'])}")
    return lines


def _listed(entries, most: int | None = None) -> str:
    """A profile's ``(name, count, ms)`` entries (benchmarks.gpu.profiles) in one line, the first ``most`` of them."""
    return "; ".join(f"{name} x{count} {ms} ms" for name, count, ms in entries[:most])


def _profile_lines(r: dict) -> list[str]:
    """A profiled call's lines (benchmarks.gpu.profiles): the profiler's wall and the device's busy time, the ops with
    the most host and device time, and the Python functions with the most time of their own."""
    share = r.get("device_busy_share")
    if r["device_busy_s"] or r["launches"]:
        device = f"the device busy {r['device_busy_s']:.3f} s ({share:.0%} of it), {r['launches']} launches"
    else:
        device = "no device activity recorded"

    def listed(key: str) -> str:
        return _listed(r.get(key, []), 6) or "(none)"

    return [
        f"under the profiler {r['wall_s_profiled']:.3f} s wall, {device}",
        f"  - most host time: {listed('top_host_ops')}",
        f"  - most device time: {listed('top_device_ops')}",
        f"  - Python, most time of their own (cProfile, {r['wall_s_cprofiled']:.3f} s): {listed('top_python')}",
        f"  - gactx's own functions {r['gactx_python_ms']:.1f} ms, most: {listed('top_gactx')}",
    ]


def _step_profile_lines(rows: list[dict], arm: str) -> list[str]:
    """Where a step's time goes, for the arm's profiled methods (training.PROFILED): one step each."""
    mine = [r for r in rows if r.get("kind") == "step-profile" and r.get("arm") == arm and "wall_s_cprofiled" in r]
    if not mine:
        return []
    lines = ["", "Where a step's time goes (one step of each under torch.profiler, one under cProfile):", ""]
    for r in mine:
        head, *rest = _profile_lines(r)
        lines += [f"- {r['model']}, {label(r['method'])}: {head}", *rest]
    return lines


def _training_table(rows: list[dict], arm: str) -> list[str]:
    mine = _training(rows, arm)
    if not mine:
        return ["(no rows)"]
    unit = mine[0]["unit"]
    size, scale = _bytes_unit(r.get("peak_bytes") for r in mine)
    headers = ["model", "method", "batch", f"peak {size}", "plain / peak", f"{unit}/s", "vs plain", "step ms",
               "max batch", "vs plain", "warm-up s", "adaptation"]  # fmt: skip
    cells = []
    for r in mine:
        adapt = ""
        if r.get("adapt_s") is not None:
            partial = f" ({r['adapt_partial']} from the probed nodes)" if r.get("adapt_partial") else ""
            adapt = f"{r['adapt_s']:.1f} s, {r['adapt_passes']} passes{partial}"
        best = r.get("max_batch")
        shown_best = "" if best is None else f"{best}" + ("" if r.get("max_batch_ended", True) else " (at least)")
        peak = _num(r["peak_bytes"] / scale) if r.get("peak_bytes") else ""
        cells.append([r["model"], label(r["method"]), r["batch"], peak, _x(r.get("peak_ratio")), _num(r.get("per_s")),
                      _x(r.get("per_s_ratio")), _num(r.get("step_ms")), shown_best, _x(r.get("max_batch_ratio")),
                      _num(r.get("warmup_s")), adapt])  # fmt: skip
    lines = markdown_table(headers, cells, left=2)
    for r in mine:
        lines += [f"- {r['model']}, {label(r['method'])}: {e}" for e in r.get("errors", [])]
        if not r.get("errors") and r.get("peak_bytes") is None:
            lines.append(f"- {r['model']}, {label(r['method'])}: begun, not finished (the arm's time ran out)")
        elif r.get("max_batch") is not None and not r.get("max_batch_ended", True):
            lines.append(f"- {r['model']}, {label(r['method'])}: the maximum batch search stopped for time")
    return lines


def render(rows: list[dict], env: dict, arms: list[dict]) -> str:
    rows = with_ratios(rows)
    lines = [f"# gactx GPU evaluation on {env.get('device_name', 'an unknown device')}", ""]
    lines += [
        f"- {_heading(env)}; transformers {env.get('transformers', '?')}, peft {env.get('peft', '?')}; "
        f"{env.get('memory_gib', 0):.1f} GiB",
        f"- `{env.get('command', 'python -m benchmarks.gpu')}`" + (" (tiny sizes: a smoke run, not a measurement)"
                                                                 if env.get("tiny") else ""),
        "- arms: " + "; ".join(f"{a['name']} {a['status']} in {a['seconds']:.0f} s (limit {a['limit_s']:.0f} s)"
                               for a in arms),
        f"- peak: {env.get('peak', '')}",
        f"- throughput: {env.get('timing', '')}",
        f"- maximum batch: {env.get('max_batch', '')}",
        "",
        "## Goals (reported, not asserted)",
        "",
    ]  # fmt: skip
    lines += markdown_table(["goal", "measured", ""], goals(rows))
    skipped = sorted(r["id"] for r in rows if r.get("kind") == "skipped")
    for arm in TITLES:
        lines += ["", f"## {TITLES[arm]}", "", _heading(env), ""]
        if arm == "tests":
            lines += _tests_lines(rows)
        elif arm in ("kernels", "host", "host-traced"):
            lines += _kernel_table(rows) if arm == "kernels" else _host_table(rows, arm)
        elif arm == "adaptation":
            lines += _adaptation_lines(rows)
        else:
            lines += _training_table(rows, arm)
            lines += _step_profile_lines(rows, arm)
        sources = sorted({f"{r['model']}: {r['source']}" for r in _training(rows, arm) if r.get("source")})
        if sources:
            lines += ["", "Built from: " + "; ".join(sources) + "."]
        backends = sorted({r["compile_backend"] for r in _training(rows, arm) if r.get("compile_backend")})
        if backends and backends != ["inductor"]:
            lines += [
                "",
                f"Compiled with the `{'`, `'.join(backends)}` backend (a CPU: Inductor's C++ build is skipped).",
            ]
        gone = [s for s in skipped if s.split("/")[0] == arm]
        if gone:
            lines += ["", "Not measured (time limit): " + ", ".join(g.split("/", 1)[1] for g in gone)]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], env: dict, path: Path) -> bool:
    """Kernels' share of clone's bandwidth by size; each training arm's throughput, peak and maximum batch
    against plain. False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = with_ratios(rows)
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    ax = axes[0][0]
    kernel = [r for r in rows if r.get("kind") == "kernel"]
    for dtype, style in (("fp32", "-"), ("bf16", "--")):
        for bits in sorted({r["bits"] for r in kernel}):
            mine = sorted((r for r in kernel if r["dtype"] == dtype and r["bits"] == bits), key=lambda r: r["size_mib"])
            if mine:
                ax.plot([r["size_mib"] for r in mine], [r["quantize_vs_clone"] for r in mine], style, marker="o",
                        label=f"quantize {dtype} {bits}b")  # fmt: skip
    ax.axhline(GOALS["quantize_vs_clone"], color="k", linewidth=0.8)
    ax.set(xscale="log", xlabel="input MiB", ylabel="share of torch.clone's GB/s", title="kernels")
    if kernel:
        ax.legend(fontsize=6)
    training = [r for r in rows if r.get("kind") == "training"]
    names = [(f"compiled {r['model']}" if r["arm"] == "compiled" else r["arm"]) + f": {label(r['method'])}"
             for r in training]  # fmt: skip
    panels = ((axes[0][1], "per_s_ratio", "throughput / plain's"), (axes[1][0], "peak_ratio", "plain's peak / peak"),
              (axes[1][1], "max_batch_ratio", "maximum batch / plain's"))  # fmt: skip
    for ax, key, title in panels:
        values = [r.get(key) or 0 for r in training]
        ax.bar(range(len(values)), values, color=["0.6" if r["method"] == PLAIN else "C0" for r in training])
        ax.set_xticks(range(len(values)), names, rotation=90, fontsize=6)
        ax.axhline(1, color="k", linewidth=0.8)
        ax.set(title=title)
    fig.suptitle(f"gactx GPU evaluation: {_heading(env)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
