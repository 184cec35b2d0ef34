"""benchmarks/roofline.py, run as a user runs it (``python -m benchmarks.kernels``), in a child process: it
compiles for a GPU, which the interpreter of this process (tests/conftest.py) cannot."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import roofline

ROOT = Path(__file__).resolve().parents[2]


def test_quick_tables_for_two_gpus(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "benchmarks.kernels", "--quick", "--gpu", "h100", "h200", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = json.loads((tmp_path / "roofline.json").read_text())  # the last device's table (h200)
    assert saved["device"] == "h200"
    rows = {r["kernel"]: r for r in saved["rows"]}
    assert set(rows) == {"quantize", "dequantize"}
    for r in rows.values():
        assert r["configuration"].startswith("dtype=fp32 bits=4 group=256") and not r["problems"], r
        assert 5 < r["instructions_per_element"] < 45 and r["registers"] > 0, r
        assert r["bytes_per_element"] == 4.531 and r["memory_us"] > 0 and r["issue_us"] > 0
    # Bytes a second differ (4.8 TB/s against 3.35), instructions a second do not: the memory time shrinks.
    assert "H100 SXM" in proc.stdout and "H200 SXM" in proc.stdout
    if not torch.cuda.is_available():
        assert all(r["measured_us"] is None for r in rows.values())
        assert "no measured time" in (tmp_path / "roofline.md").read_text()


def test_budget_is_issue_rate_over_bandwidth():
    h100, h200 = roofline.DEVICES["h100"], roofline.DEVICES["h200"]
    assert roofline.budget(h100, 1.0) == pytest.approx(132 * 4 * 32 * 1.755e9 / 3.35e12)  # about 8.85 an element-byte
    assert roofline.budget(h200, 4.53) < roofline.budget(h100, 4.53)  # more bandwidth, same SMs: less room
