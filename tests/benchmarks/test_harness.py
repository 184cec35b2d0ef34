"""benchmarks/harness.py: every benchmark's command, environment record, results and alternating timer."""

import csv
import importlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from benchmarks.harness import RESULTS, RUNS, Bench, alternate, read_results, where

ROOT = Path(__file__).resolve().parents[2]
# Every command that writes results, as (module, entry point, arguments before the output options).
BENCHMARKS = [
    ("benchmarks.adaptation", "run", []), ("benchmarks.estimators", "run", []), ("benchmarks.host", "run", []),
    ("benchmarks.oprules", "main", []), ("benchmarks.schemes", "run", []), ("benchmarks.finetune", "run", []),
    ("benchmarks.run", "run", []), ("benchmarks.peak", "main", []), ("benchmarks.kernels", "run", []),
    ("benchmarks.kernels", "run", ["--throughput"]), ("benchmarks.gpu.__main__", "main", []),
]  # fmt: skip


def test_results_go_to_the_ignored_runs_folder_unless_update_results_is_given(tmp_path):
    bench = Bench("example", "An example benchmark.\n\nMore.", quick="one row")
    assert bench.parser.description == "An example benchmark."
    assert bench.folder(bench.parse([]), "cpu") == RUNS / "cpu"
    assert bench.folder(bench.parse(["--quick"]), "cpu") == RUNS / "cpu" / "quick"  # never mixed with a real run's
    assert bench.folder(bench.parse(["--update-results"]), "cpu") == RESULTS / "cpu"
    assert bench.folder(bench.parse(["--update-results"]), "h100") == RESULTS / "h100"
    args = bench.parse(["--quick", "--out", str(tmp_path)])
    assert args.quick and bench.folder(args, "cpu") == tmp_path
    assert RESULTS == ROOT / "benchmarks" / "results" and RUNS == ROOT / "benchmarks" / "runs"


def test_a_smoke_test_never_writes_the_committed_results(capsys):
    bench = Bench("example", None, quick="one row")
    for argv in (["--quick", "--update-results"], ["--quick", "--out", str(RESULTS / "cpu")]):
        with pytest.raises(SystemExit):
            bench.parse(argv)
        assert "--quick writes a smoke test's figures" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse(["--out", "/tmp/x", "--update-results"])  # two folders named: neither is guessed
    assert "--out DIR and --update-results" in capsys.readouterr().err


@pytest.mark.parametrize(("module", "entry", "argv"), BENCHMARKS, ids=lambda v: v if isinstance(v, str) else None)
def test_every_benchmark_keeps_to_the_rule(module, entry, argv, tmp_path, capsys):
    command = getattr(importlib.import_module(module), entry)
    smoke = "--tiny" if module == "benchmarks.gpu.__main__" else "--quick"
    with pytest.raises(SystemExit):
        command([*argv, smoke, "--update-results"])  # refused before anything runs
    assert f"{smoke} writes a smoke test's figures" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        command([*argv, "--out", str(tmp_path), "--update-results"])
    assert "--out DIR and --update-results" in capsys.readouterr().err


def test_a_benchmark_without_options_leaves_the_committed_results_alone():
    from benchmarks import peak, run, throughput
    from benchmarks.gpu import __main__ as gpu

    cpu = ["--device", "cpu"]
    assert throughput.parse_args([*cpu, "--backend", "torch"]).out == RUNS / "cpu"
    assert throughput.parse_args([*cpu, "--backend", "torch", "--update-results"]).out == RESULTS / "cpu"
    assert run.parse_args(cpu).folder == RUNS / "cpu" and peak.parse_args(cpu).folder == RUNS / "cpu"
    assert run.parse_args([*cpu, "--update-results"]).folder == RESULTS / "cpu"
    results = gpu.Results(gpu.parse_args(["--tiny"]), ["--tiny"])
    results.add({"id": "env", "kind": "env", "device": "cpu"})  # the folder waits for the arms' device
    assert results.folder() == RUNS / "cpu" / "quick"


def test_a_run_says_where_it_wrote(tmp_path):
    assert where(RUNS / "cpu").endswith("(git-ignored; --update-results writes the committed benchmarks/results/)")
    assert "runs/cpu" in where(RUNS / "cpu")
    assert where(RESULTS / "cpu").endswith("cpu: the committed results (git diff shows what changed)")
    assert where(tmp_path).endswith(tmp_path.name)  # a folder of one's own: no remark


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout")
def test_git_ignores_the_runs_folder_and_not_the_committed_results():
    def ignored(path: str) -> bool:
        return subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0

    assert ignored("benchmarks/runs/cpu/kernels.json") and ignored("benchmarks/runs/cpu/quick/kernels.png")
    assert not ignored("benchmarks/results/cpu/kernels.json")


def test_results_are_json_markdown_and_csv(tmp_path):
    bench = Bench("example", None, quick=None)
    env = bench.environment("cpu", rounds=3)
    assert {"device", "device_name", "torch", "threads", "date"} <= set(env) and env["rounds"] == 3
    rows = [{"model": "a", "ms": 1.5}, {"model": "b", "ms": 2.0, "tries": [1, 2]}]
    path = bench.write(tmp_path, env, rows, "| table |\n", extra=[1])
    assert path.read_text() == "| table |\n"
    assert read_results(tmp_path, "example") == {"environment": env, "rows": rows, "extra": [1]}
    with (tmp_path / "example.csv").open() as f:
        lines = list(csv.DictReader(f))
    assert [line["model"] for line in lines] == ["a", "b"] and json.loads(lines[1]["tries"]) == [1, 2]
    assert lines[0]["tries"] == ""


def test_the_timer_alternates_the_runs():
    order = []
    turns = {"plain": lambda: order.append("plain") or 1.0, "L1": lambda: order.append("L1") or [2.0, 3.0]}
    times = alternate(turns, 2)
    assert order == ["plain", "L1", "plain", "L1"]
    assert times == {"plain": [1.0, 1.0], "L1": [2.0, 3.0, 2.0, 3.0]}
