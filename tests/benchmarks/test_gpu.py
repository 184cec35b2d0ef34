"""benchmarks/gpu: the GPU evaluation runs whole at tiny sizes (so that it cannot rot between GPU loans), cuts an
arm at its limit and keeps what it measured, searches the maximum batch, and reads its goals."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from benchmarks.gpu import __main__ as gpu
from benchmarks.gpu import report, suite, training
from benchmarks.gpu.harness import GRACE_S, MARKER, run_arm

GPU = torch.cuda.is_available()


def _evaluate(tmp_path, *arms: str) -> dict:
    code = gpu.main(["--tiny", "--arms", *arms, "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "gpu.json").read_text())
    assert [a["name"] for a in saved["arms"]] == list(arms)
    assert all(a["status"] == "done" and not a["errors"] for a in saved["arms"]), saved["arms"]
    assert code == 0
    assert saved["environment"]["tiny"] and saved["environment"]["device"] == ("cuda" if GPU else "cpu")
    return saved


def _training_rows(saved: dict, arm: str) -> dict[tuple[str, str], dict]:
    rows = report.with_ratios(saved["rows"])
    return {(r["model"], r["method"]): r for r in rows if r.get("kind") == "training" and r["arm"] == arm}


def _check_arm(saved: dict, arm: str) -> dict[tuple[str, str], dict]:
    spec, rows = training.ARMS[arm], _training_rows(saved, arm)
    assert list(rows) == [(m, method) for m in spec.models for method in spec.methods]
    adaptive = any(training.is_adaptive(m) for m in spec.methods)
    for (_, method), r in rows.items():
        assert not r.get("errors"), r
        timed = 2 * training.TIMED if method == "fp" and adaptive else training.TIMED  # plain: again beside them
        assert r["per_s"] > 0 and r["step_ms"] > 0 and r["timed_steps"] == timed, r
        assert r["peak_bytes"] > 0 and r["first_step_s"] > 0, r
        if spec.max_batch:
            assert r["max_batch_ended"] and r["max_batch"] >= r["batch"], r
            fitted = [b for b, peak in r["max_batch_tries"] if peak is not None]
            assert max(fitted, default=r["batch"]) == r["max_batch"]
            assert all(b > r["max_batch"] for b, peak in r["max_batch_tries"] if peak is None)
        if method.removeprefix("checkpoint+") in ("L2", "L2.2"):
            assert r["adapt_passes"] > 0 and r["adapt_s"] > 0
        if method == "fp":
            assert r["per_s_ratio"] == 1 and r["peak_ratio"] == 1
    return rows


def _check_step_profiles(saved: dict, arm: str) -> None:
    """The arm's profiled methods each have a step under the profiler (the device's time on a GPU only) and under
    cProfile, where plain runs none of gactx's Python and L1 some."""
    rows = {r["method"]: r for r in saved["rows"] if r.get("kind") == "step-profile" and r["arm"] == arm}
    methods = training.ARMS[arm].methods
    assert list(rows) == [m for m in methods if m in training.PROFILED], rows
    for r in rows.values():
        assert not r.get("errors") and r["wall_s_profiled"] > 0 and r["wall_s_cprofiled"] > 0, r
        assert len(r["top_host_ops"]) > 3 and len(r["top_python"]) > 3, r
        assert (r["device_busy_s"] > 0) == GPU and (r["launches"] > 0) == GPU, r
    assert rows["fp"]["gactx_python_ms"] < rows["L1"]["gactx_python_ms"], rows


@pytest.mark.slow
def test_the_tiny_evaluation_runs_the_kernels_the_lora_model_and_the_compiled_arm(tmp_path):
    saved = _evaluate(tmp_path, "kernels", "llama-lora", "compiled")
    kernels = [r for r in saved["rows"] if r.get("kind") == "kernel"]
    from benchmarks.gpu.kernels import BITS, DTYPES, TINY_SIZES_MIB

    assert {(r["dtype"], r["size_mib"], r["bits"]) for r in kernels} == {
        (d, s, b) for d in DTYPES for s in TINY_SIZES_MIB for b in BITS
    }
    for r in kernels:
        assert r["quantize_gbps"] > 0 and r["dequantize_gbps"] > 0 and r["clone_gbps"] > 0
        assert r["quantize_host_us"] > 0 and 0 < r["kept"] < 1
        assert (r["quantize_launches"] is None) == (not GPU)
    lora = _check_arm(saved, "llama-lora")
    assert lora[("llama-lora", "L1")]["peak_ratio"] > 1.2  # a tiny model's step still holds its activations
    compiled = _check_arm(saved, "compiled")
    assert compiled[("bert-large", "L1")]["peak_ratio"] > 1.2
    _check_step_profiles(saved, "llama-lora")
    _check_step_profiles(saved, "compiled")
    md = (tmp_path / "gpu.md").read_text()
    assert md.count("Where a step's time goes") == 2 and "gactx's own functions" in md
    for title in (report.TITLES[a] for a in ("kernels", "llama-lora", "compiled")):
        assert f"## {title}" in md
    assert "## Goals (reported, not asserted)" in md and "tiny sizes: a smoke run" in md
    assert (tmp_path / "gpu.png").stat().st_size > 10_000  # matplotlib: a test extra


@pytest.mark.slow
def test_the_tiny_evaluation_runs_resnet_bert_large_and_the_host_cost(tmp_path):
    saved = _evaluate(tmp_path, "resnet50", "bert-large", "host")
    _check_arm(saved, "resnet50")
    bert = _check_arm(saved, "bert-large")
    assert bert[("bert-large", "L1")]["peak_ratio"] > 1.2
    assert bert[("bert-large", "L1")]["max_batch_ratio"] > 1
    host = {r["method"]: r for r in saved["rows"] if r.get("kind") == "host"}
    assert list(host) == ["plain", "floor", "L0", "L1", "L1.1", "plain+compile", "L0+compile", "L1+compile"]
    assert all(r["step_ms"] > 0 and r["saves"] == 16 for r in host.values())
    assert f"## {report.TITLES['host']}" in (tmp_path / "gpu.md").read_text()


def test_the_tiny_evaluation_says_where_an_adaptations_time_goes(tmp_path):
    """The adaptation arm: a first and a later adaptation timed, one under the profiler (the device's busy time, ops
    with host and device time: none on a CPU) and one under cProfile, each with passes; rendered in its section."""
    saved = _evaluate(tmp_path, "adaptation")
    rows = {r["id"].split("/", 1)[1]: r for r in saved["rows"] if r.get("kind") == "adaptation"}
    assert list(rows) == ["first", "timed", "profile", "python"]
    assert all(r["seconds"] > 0 and r["passes"] > 2 for r in rows.values())
    assert sum(p for _, p in rows["timed"]["passes_by_part"].values()) == rows["timed"]["passes"]
    profile = rows["profile"]
    assert profile["wall_s_profiled"] >= profile["seconds"] > 0 and len(profile["top_host_ops"]) > 3
    assert (profile["device_busy_s"] > 0) == GPU and (len(profile["top_device_ops"]) > 0) == GPU
    assert any("groups.py" in name or "replayed.py" in name for name, _, _ in rows["python"]["top_python"]) or any(
        "run_backward" in name for name, _, _ in rows["python"]["top_python"]
    )
    md = (tmp_path / "gpu.md").read_text()
    assert f"## {report.TITLES['adaptation']}" in md and "a later adaptation:" in md and "under the profiler" in md


@pytest.mark.slow
def test_the_tiny_evaluation_times_the_traced_format_in_an_arm_of_its_own(tmp_path):
    """The host-traced arm: L1 compiled with ``backend="torch"`` against compiled plain, and eager L1 against plain,
    in a section of its own (the host arm's section holds none of its rows)."""
    saved = _evaluate(tmp_path, "host-traced")
    rows = {r["method"]: r for r in saved["rows"] if r.get("kind") == "host"}
    assert list(rows) == ["plain", "L1", "plain+compile", *gpu.TRACED]
    assert all(r["arm"] == "host-traced" and r["step_ms"] > 0 and r["saves"] == 16 for r in rows.values())
    calls = {method: row["python_calls_per_save"] for method, row in rows.items()}
    assert calls["plain"] == calls["plain+compile"] == 0 and calls["L1"] > 0 and calls["L1+compile-torch"] > 0
    md = (tmp_path / "gpu.md").read_text()
    traced = md.split(f"## {report.TITLES['host-traced']}")[1]
    assert "| 64 | L1+compile-torch |" in traced
    assert "| 64 | L1+compile-torch |" not in md.split(f"## {report.TITLES['host']}")[1].split("## ")[0]


def test_an_arm_past_its_limit_is_cut_and_keeps_what_it_sent(tmp_path):
    script = f"import json, time; print({MARKER!r} + json.dumps({{'id': 'a', 'x': 1}}), flush=True); time.sleep(60)"
    rows = []
    run = run_arm("sleepy", 1, [sys.executable, "-c", script], rows.append)
    assert run.status == "cut at its limit" and rows == [{"id": "a", "x": 1}] and run.rows == 1
    assert 1 + GRACE_S <= run.seconds < 1 + GRACE_S + 10


def test_an_arm_that_fails_says_so():
    run = run_arm("broken", 30, [sys.executable, "-c", "raise SystemExit(3)"], lambda row: None)
    assert run.status == "failed (exit 3)"


@pytest.mark.parametrize("per_sample", [10, 1, 37])
def test_the_maximum_batch_search_finds_the_largest_fit_within_its_tolerance(per_sample):
    capacity, static = 10_000, 600
    tried = []

    def peak_at(batch):  # a peak a little above the line, as a real one: the guess overshoots, then bisects
        tried.append(batch)
        peak = static + per_sample * batch + batch**2 // 50
        return peak if peak <= capacity else None

    best, tries, ended = training.search_max_batch(peak_at, 4, peak_at(4), capacity, lambda b: True)
    largest = max(b for b in range(1, 10_000) if static + per_sample * b + b**2 // 50 <= capacity)
    assert ended and largest * (1 - training.TOLERANCE) - 1 <= best <= largest
    assert peak_at(best) is not None and len(tries) <= 12


def test_the_maximum_batch_search_of_a_linear_peak_ends_in_two_tries_with_no_failure():
    # the doubling, then the line's aim at 98% of the capacity (the largest fit 10x the start, as on a GPU): less than
    # 3% more room, no failing try
    best, tries, ended = training.search_max_batch(lambda b: 1000 + 10 * b, 64, 1640, 7400, lambda b: True)
    assert ended and [peak is not None for _, peak in tries] == [True, True], tries
    assert 0.97 * 640 <= best <= 640


def test_the_maximum_batch_search_stops_for_time_with_a_lower_bound():
    best, tries, ended = training.search_max_batch(lambda b: 10 * b, 4, 40, 10_000, lambda b: b <= 8)
    assert (best, tries, ended) == (8, [(8, 80)], False)


def _row(arm, method, **figures):
    return {"kind": "training", "arm": arm, "model": arm, "method": method, **figures}


def test_goals_are_read_from_ratios_to_plain():
    rows = [
        _row("bert-large", "fp", per_s=100, peak_bytes=10 << 30, max_batch=100),
        _row("bert-large", "L1", per_s=95, peak_bytes=2 << 30, max_batch=600),
        _row("bert-large", "checkpoint", per_s=70, peak_bytes=3 << 30, max_batch=300),
        _row("resnet50", "fp", per_s=100, peak_bytes=10 << 30, max_batch=100),
        _row("resnet50", "L1", per_s=80, peak_bytes=4 << 30, max_batch=300),
        _row("resnet50", "checkpoint", per_s=70, peak_bytes=3 << 30, max_batch=300),
    ]
    found = {goal: (measured, verdict) for goal, measured, verdict in report.goals(rows)}
    assert found["bert-large: L1 throughput at least 0.90x plain's"] == ("0.95x", "met")
    assert found["resnet50: L1 throughput at least 0.85x plain's"] == ("0.80x", "not met")
    assert found["bert-large: maximum batch at least 5.3x plain's"] == ("6.00x (L1)", "met")
    assert found["resnet50: maximum batch at least 4.2x plain's"] == ("3.00x (L1)", "not met")
    assert found["llama-lora: L1 throughput at least 0.90x plain's"] == ("", "not measured")
    assert found["bert-large: faster than checkpointing at the same or a lower peak"][1] == "met"
    measured, verdict = found["resnet50: faster than checkpointing at the same or a lower peak"]
    assert verdict == "not met" and measured.startswith("no gactx method reaches its peak")


@pytest.mark.skipif(GPU, reason="a GPU is here: the full evaluation would start")
def test_without_a_gpu_only_the_tiny_run_is_allowed(capsys):
    with pytest.raises(SystemExit):
        gpu.main([])
    assert "no CUDA device here" in capsys.readouterr().err


def test_an_arm_limit_names_a_known_arm(capsys):
    with pytest.raises(SystemExit):
        gpu.main(["--tiny", "--limit", "resnet=10"])
    assert "give ARM=SECONDS" in capsys.readouterr().err


def test_the_tests_arm_runs_the_kernel_tests_and_reports_their_counts(tmp_path):
    saved = _evaluate(tmp_path, "tests")
    (row,) = [r for r in saved["rows"] if r.get("kind") == "tests"]
    assert row["passed"] > 0 and row["failed"] == 0 and row["exit_code"] == 0 and not row["stopped_for_time"], row
    assert row["files"] == list(suite.TINY_FILES) and row["triton"] and row["torch"] == torch.__version__
    assert f"{row['passed']} passed" in (tmp_path / "gpu.md").read_text()


def test_the_tests_arm_reads_pytests_summary_and_a_run_cut_before_it():
    assert suite.summary("....F\n1 failed, 4 passed, 2 skipped in 3.10s\n") == {
        "passed": 4, "failed": 1, "skipped": 2, "errors": 0,
    }  # fmt: skip
    assert suite.summary("x\n3 passed, 1 error in 0.5s") == {"passed": 3, "failed": 0, "skipped": 0, "errors": 1}
    cut = "..s.F" + "." * 67 + " [ 10%]\n..E.\n"
    assert suite.summary(cut) == {"passed": 73, "failed": 1, "skipped": 1, "errors": 1}
