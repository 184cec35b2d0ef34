"""benchmarks/host.py at a tiny size: every method is timed against its plain twin and its host cost split."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import host

ROOT = Path(__file__).resolve().parents[2]


def test_quick_host_benchmark_splits_the_cost_of_a_save(tmp_path):
    rows = {r["method"]: r for r in host.run(["--quick", "--out", str(tmp_path)])}
    native = ["L1-native"] if "L1-native" in host.methods(False, False, False) else []
    assert list(rows) == ["plain", "floor", "L0", "L1", *native, "L1.1", "plain+compile", "L0+compile", "L1+compile"]
    for r in rows.values():
        assert r["width"] == 64 and r["step_ms"] > 0 and r["saves"] == 16, r
    assert rows["plain"]["vs_plain"] == 1 and rows["plain+compile"]["vs_plain"] == 1
    assert rows["L1"]["pack_us"] > 0 and rows["L1"]["unpack_us"] > 0
    assert rows["floor"]["pack_us"] > 0 and rows["floor"]["unpack_us"] > 0  # the least eager hooks pay
    # the hooks' time less the C++ kernels': below the hooks' own, above nothing
    for name in ("floor", "L1", "L1.1"):
        r = rows[name]
        assert 0 < r["host_us"] < (r["pack_us"] + r["unpack_us"]) * 23 / 16, r  # 23 saves a step, 16 compressed
    if native:  # the native path's host work through the recording driver: its launches are host time, kept in
        r = rows["L1-native"]
        assert r["host_us"] == pytest.approx((r["pack_us"] + r["unpack_us"]) * 23 / 16, rel=1e-6), r
        assert r["python_calls_per_save"] <= 2, r
    assert host.cpu.built.quantize.__name__ == "quantize", "the kernels are put back after timing"
    assert rows["L1"]["compression_us"] == rows["L1"]["per_save_us"] - rows["L0"]["per_save_us"]
    # gactx's Python runs for eager saves; plain runs none of it
    assert rows["L1"]["python_calls_per_save"] >= 1 and rows["plain"]["python_calls_per_save"] == 0
    saved = json.loads((tmp_path / "host.json").read_text())
    assert len(saved["rows"]) == len(rows) and "| 64 | L1+compile |" in (tmp_path / "host.md").read_text()


def test_gactx_hooks_are_timed_in_place_so_each_step_is_a_pass_of_its_own():
    # gactx's hooks are timed where they are, on top: each timed step is a pass of its own, its saves replayed.
    case = host.Case("L1", 64, "cpu")
    with case.hooks():
        case.step()
    one_pass = len(case.controller.records)
    out = host.hook_us(case, 3)
    assert out["pack_us"] > 0 and out["unpack_us"] > 0 and out["host_us"] > 0
    assert len(case.controller.records) == one_pass
    assert sum(r.compressed for r in case.controller.records) == 16
    with case.hooks():  # the hooks' own functions are put back
        case.step()
    assert len(case.controller.records) == one_pass


def test_full_runs_time_the_traced_format_against_compiled_plain():
    # backend="torch" under torch.compile (full runs only: its compile takes about a minute here) is compared with
    # plain compiled the default way; the C++ wrapper's method with plain compiled so.
    names = host.methods(compiled=True, cpp=True, traced=True, device="cuda")
    assert names == ["plain", "floor", "L0", "L1", "L1-launcher", "L1.1", "plain+compile", "L0+compile", "L1+compile",
                     "L1+compile-torch", "plain+compile-cpp", "L1+compile-cpp"]  # fmt: skip
    assert host.base_of("L1+compile-torch") == "plain+compile" and host.base_of("L1+compile-cpp") == "plain+compile-cpp"
    assert host.base_of("L1.1") == "plain"
    assert "L1+compile-torch" not in host.methods(compiled=True, cpp=True, traced=False)
    assert host.Case("L1+compile-torch", 64, "cpu").controller.config.backend == "torch"
    assert host.Case("L1+compile", 64, "cpu").controller.config.backend == "auto"


def test_only_keeps_the_methods_named_eager_l1_and_their_plain_ones():
    # the GPU evaluation's host-traced arm: L1 compiled with backend="torch" against compiled plain, eager L1 (whose
    # records count the saves) against plain
    names = host.methods(compiled=True, cpp=False, traced=True, only=("L1+compile-torch",))
    assert names == ["plain", "L1", "plain+compile", "L1+compile-torch"]
    assert host.methods(compiled=False, cpp=False, traced=False, only=("L1.1",)) == ["plain", "L1", "L1.1"]


@pytest.mark.slow
def test_the_native_method_measures_native_launches_host_work_on_a_cpu(tmp_path):
    # The suite interprets Triton's kernels; the native method needs them compiled (for sm_90, launched through the
    # recording driver): a child process without TRITON_INTERPRET, as a user runs the benchmark.
    from benchmarks import driver
    from gactx.kernels import native

    if not driver.buildable() or not native.available():
        pytest.skip("needs a C compiler, the triton wheel's cuda.h and the C++ extension")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.host", "--quick", "--no-compile", "--out", str(tmp_path)],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {r["method"]: r for r in json.loads((tmp_path / "host.json").read_text())["rows"]}
    r = rows["L1-native"]
    assert r["saves"] == 16 and r["python_calls_per_save"] <= 2, r
    assert r["host_us"] > 0 and r["pack_us"] > 0 and r["unpack_us"] > 0, r
