"""benchmarks/peak.py: every method's step peak is measured and written, and gactx lowers it."""

import json

import pytest

from benchmarks.peak import main


def test_quick_peak_benchmark(tmp_path):
    main(["--quick", "--out", str(tmp_path), "--models", "bert-base", "--threads", "1", "--compiled-models",
          "mlp-gelu", "--backend", "aot_eager"])  # fmt: skip
    result = json.loads((tmp_path / "peak.json").read_text())
    rows = result["rows"]
    assert [(r["model"], r["method"]) for r in rows] == [
        (model, method) for model in ("mlp-gelu", "bert-base") for method in ("fp", "L1.1", "L1", "L1.2", "checkpoint")
    ]
    peak = {(r["model"], r["method"]): r["peak_mib"] for r in rows}
    assert peak[("mlp-gelu", "L1.2")] < peak[("mlp-gelu", "L1.1")] < peak[("mlp-gelu", "fp")]
    assert all(0 < r["saved_share_of_fp_peak"] <= 1 for r in rows)
    assert "saved counted by" in (tmp_path / "peak.md").read_text()
    compiled = {(r["compile"], r["method"]): r for r in result["compiled"]}
    assert list(compiled) == [(mode, m) for mode in ("whole", "regional") for m in ("fp", "L1.1", "L1.2")]
    for mode in ("whole", "regional"):
        assert compiled[mode, "L1.2"]["peak_mib"] < compiled[mode, "fp"]["peak_mib"]
        assert compiled[mode, "fp"]["grad_cos_compiled"] > 0.9999
        assert compiled[mode, "L1.1"]["grad_cos_compiled"] > 0.99
    assert "## Compiled (aot_eager)" in (tmp_path / "peak.md").read_text()

    # another model, merged: the rows of the models not run are kept, the LLM's added
    main(
        ["--quick", "--out", str(tmp_path), "--models", "llama-lora", "--threads", "1", "--compiled-models", "--merge"]
    )
    merged = json.loads((tmp_path / "peak.json").read_text())
    assert [r for r in merged["rows"] if r["model"] == "bert-base"] == [r for r in rows if r["model"] == "bert-base"]
    assert merged["compiled"] == result["compiled"] and set(merged["environment"]["kept"]) == {"bert-base"}
    assert set(merged["environment"]["kept_compiled"]) == {"mlp-gelu"}
    llm = {r["method"]: r["peak_mib"] for r in merged["rows"] if r["model"] == "llama-lora"}
    assert llm["L1.2"] < llm["fp"]


def test_a_quick_run_never_updates_the_committed_results(capsys):
    with pytest.raises(SystemExit):
        main(["--quick", "--update-results"])
    assert "never to the committed results" in capsys.readouterr().err
