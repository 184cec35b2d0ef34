"""benchmarks/finetune.py at tiny shapes: every section runs and says what it measured."""

import json

import pytest

pytest.importorskip("peft")

from benchmarks import finetune  # noqa: E402


def test_quick_finetune_benchmark_measures_every_section(tmp_path):
    rows = finetune.run(["--quick", "--out", str(tmp_path), "--threads", "1"])
    peaks = {(r["lora"], r["method"]): r for r in rows if r["section"] == "peaks"}
    assert peaks[(False, "plain")]["cosine"] == pytest.approx(1.0)
    assert peaks[(False, "checkpoint")]["vs_checkpoint"] == 1
    compressed = peaks[(False, "checkpoint + L1")]
    assert compressed["recomputed_held_mib"] > 0 and compressed["peak_mib"] < peaks[(False, "checkpoint")]["peak_mib"]
    assert peaks[(False, "checkpoint + L1.1")]["cosine"] > 0.999
    assert peaks[(True, "L1")]["peak_mib"] < peaks[(True, "plain")]["peak_mib"]
    training = [r for r in rows if r["section"] == "training"]
    assert {r["model"] for r in training} == {"llama", "llama-lora", "bert-base"}
    assert all(len(r["losses"]) == 4 and abs(r["vs_plain"] - 1) < 0.05 for r in training)
    ce = {(r["logits"], r["bits"]): r for r in rows if r["section"] == "cross-entropy"}
    assert ce[("learned", 8)]["logits_cosine"] > 0.999 and ce[("learned", 2)]["logits_cosine"] < 0.99
    assert ce[("model", "kept")]["stored_mib"] > ce[("model", 8)]["stored_mib"]
    saved = json.loads((tmp_path / "finetune.json").read_text())
    assert len(saved["rows"]) == len(rows) and "## Cross-entropy" in (tmp_path / "finetune.md").read_text()
    assert all((r["base_loss"] is None) == (r["model"] == "bert-base") for r in training)

    again = finetune.run(["--quick", "--out", str(tmp_path), "--threads", "1", "--sections", "cross-entropy"])
    assert [r for r in again if r["section"] != "cross-entropy"] == [r for r in rows if r["section"] != "cross-entropy"]
    merged = json.loads((tmp_path / "finetune.json").read_text())
    assert set(merged["environment"]["kept"]) == {"peaks", "lora", "training"}
    assert "- section training: from the run of" in (tmp_path / "finetune.md").read_text()
