"""benchmarks/throughput.py runs at tiny sizes and writes its tables, so that it cannot rot."""

import json

from benchmarks.throughput import run


def test_quick_kernel_benchmark_writes_rows(tmp_path):
    rows = run(["--quick", "--device", "cpu", "--out", str(tmp_path)])
    assert rows and {r["bits"] for r in rows} == {2, 4}
    assert all(r["quantize_gbps"] > 0 and r["dequantize_gbps"] > 0 and r["clone_gbps"] > 0 for r in rows)
    saved = json.loads((tmp_path / "kernels.json").read_text())
    assert saved["rows"] and "cpu" in (tmp_path / "kernels.md").read_text().lower()
