"""benchmarks/demo.py at tiny sizes: every model and method, a row printed as soon as its run ends."""

import pytest

from benchmarks import demo


@pytest.mark.slow  # the compiled rows compile BERT with Inductor
def test_every_row_is_printed_as_its_run_ends(capsys, monkeypatch):
    printed_before = []
    run_one = demo.run_one

    def recording(*args, **kwargs):  # what was printed when each run began
        printed_before.append(capsys.readouterr().out)
        return run_one(*args, **kwargs)

    monkeypatch.setattr(demo, "run_one", recording)
    rows = demo.main(["--size", "tiny", "--steps", "2"])
    expected = [(m, k) for m in demo.MODELS for k in demo.METHODS] + [
        (demo.COMPILED[0], k + "+compile") for k in demo.COMPILED[1]
    ]
    assert [(r["model"], r["method"]) for r in rows] == expected
    assert "model" in printed_before[0]  # the header first
    for i, (model, method) in enumerate(expected[:-1]):
        shown = printed_before[i + 1]  # printed between run i and run i + 1
        assert shown.startswith(model) and method in shown.split()[:2], shown
    assert all(r["activation_mib"] > 0 and r["step_ms"] > 0 for r in rows)
