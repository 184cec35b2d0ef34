"""benchmarks/demo.py at tiny sizes: every model and method, a model's rows printed as soon as its runs end,
its step times taken in turns."""

import pytest

from benchmarks import demo


@pytest.mark.slow  # the compiled rows compile BERT with Inductor
def test_a_models_rows_are_printed_as_its_runs_end(capsys, monkeypatch):
    """With --compile (the default on a GPU), the compiled BERT rows after the eager ones."""
    printed = []  # (the run about to start, what was printed since the last run began)
    run_one, timed = demo.run_one, []

    def recording(model, method, *args, **kwargs):
        printed.append(((model, method), capsys.readouterr().out))
        return run_one(model, method, *args, **kwargs)

    def alternated(model, methods, *args, trained=None, **kwargs):
        timed.append((model, tuple(methods)))
        assert [m.name for m, _ in trained] == list(methods)  # the trained runs, timed as they are
        for method, _ in trained:
            method.close()
        return {m: 1.0 + i for i, m in enumerate(methods)}

    monkeypatch.setattr(demo, "run_one", recording)
    monkeypatch.setattr(demo, "alternated_step_ms", alternated)
    rows = demo.main(["--size", "tiny", "--steps", "3", "--threads", "1", "--compile"])
    methods = {m: demo.MODEL_METHODS.get(m, demo.METHODS) for m in demo.MODELS}
    expected = [(m, k) for m in demo.MODELS for k in methods[m]] + [
        (demo.COMPILED[0], k + "+compile") for k in demo.COMPILED[1]
    ]
    assert [(r["model"], r["method"]) for r in rows] == expected
    assert "model" in printed[0][1] and printed[0][1].count("1 torch threads") == 1  # the header first, said once
    assert timed == [(m, methods[m]) for m in demo.MODELS]  # eager groups timed in turns, compiled not
    start = 0
    for model in demo.MODELS[:-1]:  # when the next model's first run starts, this one's rows are out
        start += len(methods[model])
        shown = printed[start][1].splitlines()
        assert [line.split()[:2] for line in shown if line.startswith(model)] == [[model, k] for k in methods[model]]
    eager = [r for r in rows if not r["method"].endswith("+compile")]
    assert [r["step_ms"] for r in eager] == [1.0 + i for m in demo.MODELS for i in range(len(methods[m]))]
    assert all(r["activation_mib"] > 0 and r["step_ms"] > 0 for r in rows)


def test_on_a_cpu_the_demo_leaves_the_compiled_rows_out_unless_asked(monkeypatch):
    """Inductor's compiles of the compiled BERT rows took 49 of the demo's 165 s on a 2-core CPU: there they run only
    with --compile, and the header says nothing of them."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    calls = []
    monkeypatch.setattr(demo, "run_one", lambda model, method, *a, compiled=False, **k: calls.append(compiled))
    monkeypatch.setattr(demo, "MODELS", ())  # no eager model: only what the options add
    monkeypatch.setattr(demo, "compare", lambda rows: None)
    monkeypatch.setattr(demo, "_row", lambda row, rows: "")
    demo.main(["--size", "tiny", "--steps", "3", "--threads", "1"])
    assert calls == []
    demo.main(["--size", "tiny", "--steps", "3", "--threads", "1", "--compile"])
    assert calls == [True] * len(demo.COMPILED[1])


def test_the_demo_extra_installs_what_the_demos_models_import():
    """``make demo`` installs gactx's ``demo`` extra and nothing else: every package the demo's models import must be
    in it (the LoRA decoder's peft was not, and the demo failed at its LLM on a new machine)."""
    import re
    from pathlib import Path

    text = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    listed = re.search(r"^demo = \[(.*?)\]$", text, re.MULTILINE).group(1)  # one line (tomllib: Python 3.11)
    extra = {re.split(r"[<>=\[ ;]", r.strip(' "'), maxsplit=1)[0].lower() for r in listed.split(",")}
    needed = {"tqdm"}  # the progress bar
    needs = {"sage": {"torch_geometric"}, "bert-base": {"transformers"}, "llama-lora": {"transformers", "peft"}}
    for model in demo.MODELS:
        needed |= needs.get(model, set())
    assert needed <= extra, needed - extra


def test_the_llm_trains_half_the_steps(monkeypatch):
    """The LLM's loss moves little in a few steps and its 4 methods at 30 steps were half the demo's time: it trains
    half of --steps (at least 3), its step times taken on those runs in 3 rounds; the other models train --steps and
    are timed in 5."""
    steps = {}

    def run_one(model, method, precision, args, compiled=False, keep=None):
        steps.setdefault(model, set()).add(args.train_steps)
        return {"model": model, "method": method, "batch": 1}

    def alternated(model, methods, precision, args, rounds=5, trained=None):
        steps[model].add(args.train_steps)
        timed[model] = rounds
        return {m: 1.0 for m in methods}

    timed = {}

    monkeypatch.setattr(demo, "run_one", run_one)
    monkeypatch.setattr(demo, "alternated_step_ms", alternated)
    monkeypatch.setattr(demo, "MODELS", ("sage", "llama-lora"))
    monkeypatch.setattr(demo, "compare", lambda rows: None)
    monkeypatch.setattr(demo, "_row", lambda row, rows: "")
    demo.main(["--size", "tiny", "--steps", "10", "--threads", "1", "--no-compile"])
    assert steps == {"sage": {10}, "llama-lora": {5}} and timed == {"sage": 5, "llama-lora": 3}
    steps.clear()
    demo.main(["--size", "tiny", "--steps", "4", "--threads", "1", "--no-compile"])
    assert steps == {"sage": {4}, "llama-lora": {3}}


def test_models_trains_the_models_named_only(monkeypatch):
    calls = []

    def run_one(model, method, *args, compiled=False, **kwargs):
        calls.append((model, compiled))
        return {"batch": 1}

    monkeypatch.setattr(demo, "run_one", run_one)
    monkeypatch.setattr(demo, "alternated_step_ms", lambda model, methods, *a, **k: dict.fromkeys(methods, 1.0))
    monkeypatch.setattr(demo, "compare", lambda rows: None)
    monkeypatch.setattr(demo, "_row", lambda row, rows: "")
    demo.main(["--size", "tiny", "--steps", "3", "--threads", "1", "--models", "sage", "--compile"])
    assert {model for model, _ in calls} == {"sage"} and not any(compiled for _, compiled in calls)
    assert len(calls) == len(demo.MODEL_METHODS.get("sage", demo.METHODS))
