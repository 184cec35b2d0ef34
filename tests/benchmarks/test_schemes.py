"""benchmarks/schemes.py runs at tiny sizes and writes its tables, so that it cannot rot."""

import json

from benchmarks.schemes import run


def test_quick_schemes_benchmark(tmp_path):
    result = run(["--quick", "--out", str(tmp_path)])
    rows = result["rows"]
    assert [(r["model"], r["config"]) for r in rows] == [
        (m, c) for m in ("zoo:mlp", "gcn") for c in ("uniform only", "all schemes")
    ]
    for r in rows:
        assert 0 < r["relative_error"] < 10 and r["allocated_bytes"] <= r["budget_bytes"]
        assert r["tensors"] > 0 and r["packed_bytes"] < r["original_bytes"]
    assert [(t["model"], t["config"]) for t in result["training"]] == [
        ("gcn", c) for c in ("full precision", "uniform only", "all schemes")
    ]
    full = result["training"][0]
    assert full["chosen"] == {} and full["seeds"] == 1 and full["final_loss"] > 0
    assert json.loads((tmp_path / "schemes.json").read_text())["training"] == result["training"]
    text = (tmp_path / "schemes.md").read_text()
    assert "## Gradient error at equal bytes" in text and "| gcn | all schemes | gact |" in text


def test_a_partial_run_measures_its_rows_again_in_their_places(tmp_path):
    first = run(["--quick", "--out", str(tmp_path), "--parts", "errors"])
    for r in first["rows"]:
        r["relative_error"] = -1.0  # marks a row not measured again
    (tmp_path / "schemes.json").write_text(json.dumps(first))
    again = run(["--quick", "--out", str(tmp_path), "--parts", "errors", "--models", "gcn", "--configs", "all schemes"])
    rows = again["rows"]
    assert [(r["model"], r["config"]) for r in rows] == [(r["model"], r["config"]) for r in first["rows"]]
    assert [r["relative_error"] > 0 for r in rows] == [False, False, False, True]
