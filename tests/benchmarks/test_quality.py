"""benchmarks/quality.py runs at tiny sizes and writes its table, curves and plot, so that it cannot rot; its
summaries read what they should."""

import json
import math

import pytest

from benchmarks.quality import FINAL, METHODS, SPECS, final_loss, main, steps_to, summarise


def test_quick_quality_benchmark(tmp_path):
    rows = main(["--quick", "--seeds", "2", "--out", str(tmp_path)])
    assert [(r["workload"], r["method"]) for r in rows] == [(w, m) for w in SPECS for m in METHODS]
    for r in rows:
        assert r["seeds"] == 2 and len(r["finals"]) == 2 and math.isfinite(r["final_mean"])
        assert r["final_min"] <= r["final_mean"] <= r["final_max"] and 0 <= r["accuracy"] <= 1
        if r["method"] == "fp":
            assert r["vs_fp"] == 0 and r["held_mib"] is None
        else:
            assert r["held_mib"] > 0
    held = {(r["workload"], r["method"]): r["held_mib"] for r in rows}
    assert all(held[w, "L1.2"] < held[w, "L1"] < held[w, "L1.1"] for w in SPECS)  # narrower levels hold less
    assert sum(r["default"] for r in rows) == len(SPECS)  # one default level a workload
    saved = json.loads((tmp_path / "quality.json").read_text())
    assert set(saved["curves"]) == set(SPECS) and len(saved["curves"]["decoder"]["fp"]) == 2
    assert "| decoder | L1 (default) |" in (tmp_path / "quality.md").read_text()
    assert (tmp_path / "quality.png").stat().st_size > 10_000


def test_final_loss_and_steps_to_a_threshold():
    losses = [5.0, 4.0, 3.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert final_loss(losses) == 1.0
    assert steps_to(losses, 3.0) == 5  # the first full window of FINAL steps whose mean is at most 3
    assert steps_to(losses, 1.0) == 9
    assert steps_to(losses, 0.5) is None
    assert FINAL == 5


def test_summaries_read_against_full_precisions_mean():
    run = lambda losses: {"seed": 0, "losses": losses, "held_bytes": 2**20, "accuracy": 0.5}  # noqa: E731
    fp = [{**run([2.0] * 10), "held_bytes": None}, {**run([4.0] * 10), "held_bytes": None}]
    rows = summarise({"fp": fp, "L1": [run([3.3] * 10), run([3.3] * 10)]})
    assert rows[0]["vs_fp"] == 0 and rows[1]["vs_fp"] == pytest.approx(0.1)
    assert rows[1]["held_mib"] == 1.0 and rows[1]["final_std"] == 0 and rows[1]["accuracy"] == 0.5
    assert rows[1]["steps_to_threshold"] == 5 and rows[1]["reached"] == "2/2"  # 3.3 <= 1.1 * 3
    late = summarise({"fp": fp, "L1": [run([3.4] * 10), run([3.3] * 10)]})[1]
    assert late["steps_to_threshold"] is None and late["reached"] == "1/2"
