"""benchmarks/oprules.py: FewBit beats a quantized input at equal bits, and the tables are written."""

import json

from benchmarks.oprules import main
from benchmarks.table import markdown_table


def test_quick_oprules_benchmark(tmp_path):
    main(["--quick", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "oprules.json").read_text())
    assert {r["function"] for r in rows["rows"]} == {"gelu", "silu", "tanh"}  # the gradient errors
    assert all(r["fewbit_error"] < r["quantized_error"] for r in rows["rows"])
    assert (tmp_path / "oprules.csv").read_text().startswith("function,")
    wider = {(r["logit_scale"], r["bits"]): r["error_one_draw"] for r in rows["attention"]}
    assert all(wider[(s, 2)] > wider[(s, 4)] > wider[(s, 8)] for s in (1.0, 4.0))
    assert [r["model"] for r in rows["cost"]] == ["bert-base", "resnet50", "gat"]
    assert all(r["aten_ops_per_forward"] > 50 and r["watch_us_per_op"] > 0 for r in rows["cost"])
    assert "FewBit better by" in (tmp_path / "oprules.md").read_text()


def test_markdown_table_aligns_names_left_and_numbers_right():
    assert markdown_table(("model", "ms"), [("gat", 1.5)]) == ["| model | ms |", "|---|--:|", "| gat | 1.5 |"]
