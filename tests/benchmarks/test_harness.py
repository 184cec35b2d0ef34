"""benchmarks/harness.py: every benchmark's command, environment record, results and alternating timer."""

import csv
import json

import pytest

from benchmarks.harness import Bench, alternate, read_results


def test_a_smoke_test_writes_only_where_out_says(tmp_path):
    bench = Bench("example", "An example benchmark.\n\nMore.", quick="one row")
    assert bench.parser.description == "An example benchmark."
    with pytest.raises(SystemExit):
        bench.parse(["--quick"])  # the committed results stay as they are
    args = bench.parse(["--quick", "--out", str(tmp_path)])
    assert args.quick and args.out == tmp_path


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
