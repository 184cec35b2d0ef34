"""benchmarks/run.py at tiny sizes: every model, every method, bf16, the sweep and its plot, so that none rots."""

import json

import pytest
import torch

from benchmarks import harness, workloads
from benchmarks.device import device_name
from benchmarks.methods import METHODS
from benchmarks.run import run


def test_every_model_trains_and_is_measured(tmp_path):
    rows = run(["--quick", "--methods", "fp", "L1.2", "--precisions", "fp32", "--out", str(tmp_path)])
    assert {r["model"] for r in rows} == set(workloads.names())
    for r in rows:
        assert r["step_ms"] > 0 and r["activation_mib"] > 0 and 0 <= r["accuracy"] <= 1, r
    fp = {r["model"]: r for r in rows if r["method"] == "fp"}
    for r in (r for r in rows if r["method"] == "L1.2"):
        # gactx holds less than plain PyTorch saves. Under 1 MiB (tiny ViT on a GPU: 75 KiB) the CUDA
        # allocator's 512-byte blocks and the tensors kept under min_numel leave less to gain.
        small_on_gpu = torch.cuda.is_available() and fp[r["model"]]["activation_mib"] < 1
        assert r["activation_ratio"] > (1.0 if small_on_gpu else 1.5), r
    saved = json.loads((tmp_path / "models.json").read_text())
    assert saved["environment"]["size"] == "tiny" and len(saved["rows"]) == len(rows)
    assert (
        device_name("cuda" if torch.cuda.is_available() else "cpu").split(" (")[0]
        in (tmp_path / "models.md").read_text()
    )
    merged = run(["--quick", "--methods", "fp", "--precisions", "fp32", "--models", "gcn", "--merge",
                  "--out", str(tmp_path)])  # fmt: skip
    assert [r for r in merged if r["model"] != "gcn"] == [r for r in rows if r["model"] != "gcn"]
    assert [r["method"] for r in merged if r["model"] == "gcn"] == ["fp"]
    saved = json.loads((tmp_path / "models.json").read_text())
    assert "gcn" not in saved["environment"]["kept"] and "bert-base" in saved["environment"]["kept"]
    assert "from the run of" in (tmp_path / "models.md").read_text()


def test_every_method_in_both_precisions_with_a_sweep(tmp_path):
    pytest.importorskip("matplotlib")
    rows = run(["--quick", "--models", "gcn", "--sweep", "--out", str(tmp_path)])
    expected = set(METHODS) - {"checkpoint-fast", "checkpoint-selective"}  # the GPU evaluation's peers, asked for
    if not torch.cuda.is_available():
        expected -= {"save_on_cpu", "L3"}  # nothing to offload to on a CPU
    assert {r["method"] for r in rows} == expected | {m + "+bf16" for m in expected}
    assert all(len(r["sweep"]) >= 2 for r in rows)
    assert (tmp_path / "batch_throughput.png").stat().st_size > 10_000


def test_compiled_runs_are_measured_beside_eager(tmp_path):
    args = ["--quick", "--models", "bert-base", "--methods", "fp", "L1.2", "--precisions", "fp32", "--compile"]
    rows = {r["method"]: r for r in run([*args, "--out", str(tmp_path)])}
    assert list(rows) == ["fp", "L1.2", "fp+compile", "L1.2+compile"]
    compiled = rows["L1.2+compile"]
    assert compiled["activation_ratio"] > 1.5, compiled  # against fp+compile: compressed inside the graphs
    assert compiled["peak_mib"] < rows["fp+compile"]["peak_mib"]
    assert 0 <= compiled["accuracy"] <= 1


def test_step_times_in_turns_leave_no_hooks_installed():
    import argparse

    import torch

    from benchmarks.run import alternated_step_ms

    args = argparse.Namespace(size="tiny", device="cpu", batch=None, warmup=1)
    times = alternated_step_ms("resnet50", ["fp", "L1", "checkpoint"], "fp32", args, rounds=2, steps=1)
    assert list(times) == ["fp", "L1", "checkpoint"] and all(t > 0 for t in times.values())
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_trained_runs_are_timed_as_they_are_and_adapt_once():
    """The demo times the runs it trained: an adaptive level's first adaptation is paid once, not again on a fresh
    model, and the runs are closed after."""
    import argparse

    import torch

    from benchmarks.run import alternated_step_ms, run_one

    args = argparse.Namespace(
        size="tiny", device="cpu", batch=None, train_steps=3, warmup=1, timed=1, max_batch=False, sweep=False
    )
    kept = []
    for method in ("fp", "L2.2"):
        run_one("sage", method, "fp32", args, keep=kept)
    (_, _), (adaptive, _) = kept
    first = adaptive.controller.last_adaptation
    assert first is not None
    times = alternated_step_ms("sage", ["fp", "L2.2"], "fp32", args, rounds=2, steps=1, trained=kept)
    assert list(times) == ["fp", "L2.2"] and all(t > 0 for t in times.values())
    assert adaptive.controller.last_adaptation is first, "no second first adaptation"
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_a_merge_keeps_the_rows_of_the_folder_it_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "RESULTS", tmp_path / "results")  # the committed results, here a copy's
    monkeypatch.setattr(harness, "RUNS", tmp_path / "runs")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    committed, ignored = harness.results_folder(None, device, update=True), harness.results_folder(None, device)
    assert committed.parent == tmp_path / "results" and ignored.parent == tmp_path / "runs"

    def saved(folder):
        return json.loads((folder / "models.json").read_text())["rows"]

    # --quick's sizes, without --quick: a smoke test never writes the committed results
    tiny = ["--size", "tiny", "--train-steps", "4", "--warmup", "1", "--timed", "2", "--methods", "fp",
            "--precisions", "fp32", "--device", device]  # fmt: skip
    first = run([*tiny, "--models", "gcn", "--update-results"])
    assert saved(committed) == first
    # without --update-results: the ignored folder, with no earlier rows to keep; the committed ones untouched
    alone = run([*tiny, "--models", "sage", "--merge"])
    assert [r["model"] for r in alone] == ["sage"] and saved(ignored) == alone and saved(committed) == first
    # with it: the committed rows of the models not run are kept
    merged = run([*tiny, "--models", "sage", "--merge", "--update-results"])
    assert [r["model"] for r in merged] == ["gcn", "sage"] and merged[0] == first[0] and saved(committed) == merged
