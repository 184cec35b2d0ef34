"""benchmarks/later.py: later adaptations' allocations against each tensor measured alone, at its quick size."""

import json

from benchmarks import later
from gactx.controller.adaptation import passes


def test_quick_run_compares_each_tensor_alone_with_the_estimator_as_it_is(tmp_path):
    rows = later.run(["--quick", "--out", str(tmp_path)])
    assert [(r["model"], r["arm"]) for r in rows] == [("zoo:resnet", "alone"), ("zoo:resnet", "as is")]
    assert all(len(r["errors"]) == 2 and len(r["passes"]) == 3 and r["error"] > 0 for r in rows)
    assert rows[0]["ratio"] == 1.0 and rows[1]["ratio"] == rows[1]["error"] / rows[0]["error"]
    assert passes.ROTATE  # each arm sets it back
    data = json.loads((tmp_path / "later.json").read_text())
    assert data["rows"] == json.loads(json.dumps(rows))
    assert "| zoo:resnet | as is | 1 |" in (tmp_path / "later.md").read_text()
