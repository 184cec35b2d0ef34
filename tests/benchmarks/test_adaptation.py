"""benchmarks/adaptation.py runs at tiny sizes and writes its table, so that it cannot rot."""

import json

from benchmarks.adaptation import LATER, run


def test_quick_adaptation_benchmark(tmp_path):
    rows = run(["--quick", "--out", str(tmp_path)])
    assert [r["model"] for r in rows] == ["digits_cnn", "char_transformer", "resnet50", "bert-base", "llama-lora"]
    for r in rows:
        # the first adaptation estimates twice, each time 1 pass, then 2 for the inputs of linear and convolution
        # layers together and 2 for each other tensor at least (more for normalisation inputs and calibration pairs)
        assert r["passes"] >= 2 * 3 and r["tensors_measured"] > 3
        assert 0 < r["share_at_interval"] < 1 and r["adaptation_s"] > 0
        # later adaptations: one estimate each
        assert len(r["later_passes"]) == len(r["later_each_s"]) == LATER and 0 < r["later_share_at_interval"] < 1
        assert all(3 <= p < r["passes"] for p in r["later_passes"])
        assert abs(r["later_s"] - sum(r["later_each_s"]) / LATER) < 1e-3  # their mean (each rounded to 1 ms)
        assert 0 < r["later_share_backed_off"] < r["later_share_at_interval"]
        # where they went, part by part: every pass counted once
        assert sum(p for _, p in r["passes_by_part"].values()) == r["passes"]
        assert sum(p for _, p in r["later_passes_by_part"].values()) == r["later_passes"][-1]
    table = (tmp_path / "adaptation.md").read_text()
    assert "- resnet50: first " in table and " discovery, " in table
    assert "share at interval" in table and "Schedule: char_transformer, 12 steps at adapt_interval=3" in table
    schedule = json.loads((tmp_path / "adaptation.json").read_text())["schedule"]
    assert schedule["adapted_at"][0] == 1 and len(schedule["adapted_at"]) == len(schedule["stable"])
    assert all(step % 3 == 0 for step in schedule["adapted_at"][1:]) and 0 < schedule["share"] < 1
