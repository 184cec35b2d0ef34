"""What Triton's own launcher passes the CUDA driver for gactx's kernels, read on this CPU machine through a recording
driver (benchmarks/driver/recording.c, built against the cuda.h in the triton wheel, in place of libcuda.so.1): the
cubin, grid, block, dynamic shared memory, stream and the bytes of every parameter, the scratch pointers of newer
Tritons included. Against it, the launches from C++ (gactx.kernels.native, docs/gpu.md#launches): one configuration of
every kernel family; every configuration of the kernels that the native packers of replayed saves launch; and the
eager lane's saves packed by them, with no Python of gactx's.

The launches run in child processes (driver/*.py): this process runs kernels under Triton's interpreter, and its torch
sees no GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.driver import build
from gactx.controller.compiled import INLINE
from gactx.controller.lane import PYTHON_HAS_LANE
from gactx.kernels import _triton

HERE = Path(__file__).parent / "driver"
ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not _triton.HAS_TRITON, reason="needs triton")


@pytest.fixture(scope="module")
def recording_driver(tmp_path_factory) -> Path:
    built = build(tmp_path_factory.mktemp("recording-driver"))
    if built is None:
        pytest.skip("needs a C compiler and the cuda.h of the triton wheel")
    return built.parent


def _launch(folder: Path, tmp_path: Path, child: str = "triton_launch.py") -> tuple[list[dict], list[str]]:
    log, out = tmp_path / "driver.log", tmp_path / "launches.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {
        "LD_LIBRARY_PATH": os.pathsep.join([str(folder), env.get("LD_LIBRARY_PATH", "")]),
        "TRITON_LIBCUDA_PATH": str(folder),
        "GACTX_RECORDING_DRIVER_LOG": str(log),
        "TRITON_CACHE_DIR": str(tmp_path / "cache"),  # Triton's launcher module, built against the recording driver
        "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, str(HERE / child), str(out)], env=env, cwd=ROOT, capture_output=True,
        text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text()), log.read_text().splitlines()


@pytest.mark.slow
def test_triton_and_cpp_launch_each_family_with_the_arguments_its_signature_gives(recording_driver, tmp_path):
    from gactx.kernels import aot

    launches, log = _launch(recording_driver, tmp_path)
    assert {launch["family"] for launch in launches} == set(aot.FAMILIES)
    recorded = [line for line in log if line.startswith("launch ")]
    functions = [line.split()[1] for line in log if line.startswith("function ")]
    assert functions == [launch["name"] for launch in launches for _ in ("triton", "native")]
    assert recorded[1::2] == recorded[::2], "a launch from C++ differs from Triton's"
    for launch, line in zip(launches, recorded[::2], strict=True):
        head, _, params = line.partition(" params")
        grid = " ".join(map(str, launch["grid"]))
        expected = (
            f"launch grid {grid} block {launch['block']} 1 1 shared {launch['shared']} stream {launch['stream']:#x}"
        )
        where, _, function = head.partition(" function ")
        assert where == expected and function.endswith(":" + launch["name"]), launch["family"]
        assert params.split() == launch["params"], launch["family"]  # every parameter, byte for byte
        assert all(size in (None, 0) for size in launch["scratch"]), "a kernel asks for global scratch memory"


@pytest.mark.slow
def test_native_packers_launch_every_configuration_as_tritons_launcher_does(recording_driver, tmp_path):
    # Each configuration packed and unpacked by a native packer (the eager lane's call for a CUDA save), then the same
    # two launches through Triton's launcher with the kernels aot.specs lists: the same cubin, grid, block, shared
    # memory, stream and parameter bytes.
    done, log = _launch(recording_driver, tmp_path, "packer_launch.py")
    assert not any(done["problems"].values()), done["problems"]
    configurations = done["configurations"]
    assert len(configurations) == 3 * 4 * 2 * 2 + 3 * 3 * 2 + 2
    assert {c["config"]["n"] >= 2**31 for c in configurations} == {True, False}
    recorded = [line for line in log if line.startswith("launch ")]
    assert len(recorded) == 4 * len(configurations)
    for i, each in enumerate(configurations):
        native_encode, triton_encode, native_decode, triton_decode = recorded[4 * i : 4 * i + 4]
        assert native_encode == triton_encode, each["config"]
        assert native_decode == triton_decode, each["config"]
        for line, sizes in ((native_encode, each["sizes"][0]), (native_decode, each["sizes"][1])):
            params = line.partition(" params ")[2].split()
            assert [len(p) // 2 for p in params] == sizes, each["config"]


@pytest.mark.slow
def test_the_eager_lane_packs_replayed_saves_by_native_launches_with_no_python(recording_driver, tmp_path):
    # 8 x (Linear + GELU) at L1 through the recording driver: each compressed save of a replayed step is one launch to
    # pack it (uniform codes or FewBit's bins) and one to unpack it, from the lane's C++ call; gactx's Python runs
    # only a step's own calls (iterate(), the model's hook), under 2 a save.
    got, _ = _launch(recording_driver, tmp_path, "native_lane.py")
    assert got["problems"] == {}
    assert got["native"] == got["cpu"], "the records of native launches differ from the C++ kernels'"
    compressed = sum(r[4] for r in got["native"])
    assert compressed == 16
    names = [line.split(" function ")[1].split(":")[1] for line in got["launches"]]
    packs = [n for n in names if n in ("_quantize_kernel", "_encode_bins_kernel")]
    unpacks = [n for n in names if n in ("_dequantize_kernel", "_decode_table_kernel")]
    assert len(packs) == compressed and len(packs) + len(unpacks) == len(names)
    # the model's input, alive and unchanged at its backward, is read as it is: every other save decoded
    assert len(unpacks) == compressed - 1
    assert {n: names.count(n) for n in set(names)} == {
        "_quantize_kernel": 8, "_dequantize_kernel": 7, "_encode_bins_kernel": 8, "_decode_table_kernel": 8,
    }  # fmt: skip
    assert got["loads"] == [], "a replayed step loads no kernel"
    if PYTHON_HAS_LANE:  # (before it, each save runs the Python path's hooks)
        assert got["python_calls"] <= 2 * compressed, got["python_calls"]
    assert got["alive_after"] == 0, "a handle outlived its backward"
    assert got["report"] == "replayed saves on cpu: 16 of 16 packed by native launches"
    assert got["unaligned"] == [False, True, True]  # an unaligned tensor goes the Python way (Triton's launcher)
    # compiled: the graphs' saves by the C++ ops, each one launch a way; a step's own Python only
    graph = got["compiled"]
    if not INLINE:  # a torch older than 2.10: its compiled graphs keep their saves as they are
        assert graph is None
        return
    assert graph["compressed"] == 16 and graph["report"] == "compiled graphs' saves stored by native launches: 16 of 16"
    assert sorted(graph["launches"]) == ["_dequantize_kernel"] * 16 + ["_quantize_kernel"] * 16
    assert graph["python_calls"] <= 2 * graph["compressed"], graph["python_calls"]
    # captured by CUDA graphs: each stochastic quantize (all 16 at L1) reads its seed on the device, advanced by a
    # launch of its own just before it: a replay draws new noise
    captured = [(line.split(" function ")[1].split(" params")[0], line.partition(" params")[2].split()) for line in
                graph["captured"]]  # fmt: skip
    kernels = [name.split(":")[1] for name, _ in captured]
    assert kernels[: 2 * 16 : 2] == ["_advance_seed_kernel"] * 16
    assert kernels[1 : 2 * 16 : 2] == ["_quantize_kernel"] * 16 and kernels[32:] == ["_dequantize_kernel"] * 16
    for (_, advance), (_, quantize) in zip(captured[0:32:2], captured[1:32:2], strict=True):
        assert quantize[4] == advance[0], "the quantize reads the seed its advance wrote"
    uncaptured = graph["uncaptured_quantize"].split(" function ")[1].split()[0]
    assert all(function != uncaptured for function, _ in captured[1:32:2]), "the variant that reads its seed"


def test_native_launches_name_what_they_cannot_take():
    from types import SimpleNamespace

    from gactx.kernels import native

    plain = SimpleNamespace(name="k", global_scratch_size=0, profile_scratch_size=0)
    assert native.kinds({"x": "*fp32", "n": "i32", "seed": "i64", "s": "fp32", "B": "constexpr"}, plain) == "piqfpp"
    assert native.kinds({"x": "*bf16"}, SimpleNamespace(name="k")) == "p"  # a Triton that passes no scratch
    with pytest.raises(ValueError, match="not fp16"):
        native.kinds({"x": "fp16"}, plain)
    with pytest.raises(ValueError, match="asks for"):
        native.kinds({"x": "*fp32"}, SimpleNamespace(name="k", global_scratch_size=64, profile_scratch_size=0))
    if native.available():
        with pytest.raises(RuntimeError, match="cannot open"):
            native.open_driver("libgactx-no-such-driver.so")
