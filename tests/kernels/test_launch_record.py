"""What Triton's own launcher passes the CUDA driver for gactx's kernels, read on this CPU machine through a recording
driver (driver/recording.c, built here against the cuda.h in the triton wheel, in place of libcuda.so.1): for one
configuration of every kernel family compiled for sm_90, the function, grid, block, dynamic shared memory, stream and
the bytes of every parameter, the scratch pointers of newer Tritons included; and the same launch from C++
(gactx.kernels.native), which must make the same call (docs/gpu.md#launches).

The launches run in a child process (driver/triton_launch.py): this process runs kernels under Triton's interpreter,
and its torch sees no GPU."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gactx.kernels import _triton

HERE = Path(__file__).parent / "driver"
ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not _triton.HAS_TRITON, reason="needs triton")


def _cuda_h() -> Path | None:
    import triton

    found = Path(triton.__file__).parent / "backends" / "nvidia" / "include" / "cuda.h"
    return found if found.exists() else None


@pytest.fixture(scope="module")
def recording_driver(tmp_path_factory) -> Path:
    compiler, header = shutil.which("cc") or shutil.which("gcc"), _cuda_h()
    if compiler is None or header is None:
        pytest.skip("needs a C compiler and the cuda.h of the triton wheel")
    folder = tmp_path_factory.mktemp("recording-driver")
    sources = [str(HERE / "recording.c"), str(HERE / "tensor_maps.c")]
    cmd = [compiler, "-shared", "-fPIC", "-O1", f"-I{header.parent}", *sources, "-o", str(folder / "libcuda.so.1")]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    (folder / "libcuda.so").symlink_to("libcuda.so.1")  # what Triton 3.5's launcher links (-lcuda)
    return folder


def _launch(folder: Path, tmp_path: Path) -> tuple[list[dict], list[str]]:
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
        [sys.executable, str(HERE / "triton_launch.py"), str(out)], env=env, cwd=ROOT, capture_output=True,
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
        assert head == expected, launch["family"]
        assert params.split() == launch["params"], launch["family"]  # every parameter, byte for byte
        assert all(size in (None, 0) for size in launch["scratch"]), "a kernel asks for global scratch memory"


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
