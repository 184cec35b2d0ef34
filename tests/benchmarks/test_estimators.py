"""benchmarks/estimators.py: the rank correlation it reports, and a run at tiny sizes."""

import json

import numpy as np
import pytest

from benchmarks import estimators


def test_spearman_ranks_ties_by_their_mean():
    assert estimators.ranks([3.0, 1.0, 3.0, 2.0]).tolist() == [2.5, 0.0, 2.5, 1.0]
    assert estimators.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert estimators.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    a, b = [0.1, 5.0, 0.0, 0.0, 2.0], [1.0, 3.0, 0.0, 0.0, 9.0]
    ra, rb = estimators.ranks(a), estimators.ranks(b)
    assert estimators.spearman(a, b) == pytest.approx(np.corrcoef(ra, rb)[0, 1])
    assert np.isnan(estimators.spearman([1, 1, 1], [1, 2, 3]))


def test_quick_run_writes_both_tables(tmp_path):
    rows = estimators.run(["--quick", "--out", str(tmp_path)])
    assert [r["model"] for r in rows] == ["zoo/mlp", "zoo/transformer_layer"]
    data = json.loads((tmp_path / "estimators.json").read_text())
    assert data["pooled"]["tensors"] == sum(r["compared"] for r in rows) >= 8
    mlp = rows[0]
    assert mlp["spearman"] == pytest.approx(1.0) and mlp["gact_s"] > 0 and mlp["step_s"] > 0
    assert all(t["actnn"] >= 0 for r in rows for t in r["per_tensor"])
    assert "| zoo/mlp | 4 | 1.000 |" in (tmp_path / "estimators.md").read_text()
