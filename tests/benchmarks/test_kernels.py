"""benchmarks/kernels.py: ``--throughput`` runs the throughput sweep; without it, the roofline tables."""

import subprocess
import sys

import pytest

from benchmarks import kernels


def test_throughput_flag_runs_the_sweep(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(kernels.throughput, "run", lambda argv: calls.append(("throughput", argv)))
    monkeypatch.setattr(kernels.roofline, "run", lambda argv: calls.append(("roofline", argv)))
    kernels.run(["--throughput", "--quick"])
    kernels.run(["--gpu", "h200"])
    assert calls == [("throughput", ["--quick"]), ("roofline", ["--gpu", "h200"])]


def test_help_shows_both_forms_and_the_roofline_runs_as_a_module(capsys):
    with pytest.raises(SystemExit):
        kernels.run(["--help"])
    assert "--throughput" in capsys.readouterr().out
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.roofline", "--help"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr
