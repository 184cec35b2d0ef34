"""benchmarks/kernels.py: ``--throughput`` runs the throughput sweep; without it, the roofline tables."""

from benchmarks import kernels


def test_throughput_flag_runs_the_sweep(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(kernels.throughput, "run", lambda argv: calls.append(("throughput", argv)))
    monkeypatch.setattr(kernels.roofline, "run", lambda argv: calls.append(("roofline", argv)))
    kernels.run(["--throughput", "--quick"])
    kernels.run(["--gpu", "h200"])
    assert calls == [("throughput", ["--quick"]), ("roofline", ["--gpu", "h200"])]
