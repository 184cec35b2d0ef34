"""What Triton's own launcher passes the CUDA driver for gactx's kernels, read on this CPU machine through a recording
driver (driver/recording.c, built here against the cuda.h in the triton wheel, in place of libcuda.so.1): for one
configuration of every kernel family compiled for sm_90, the function, grid, block, dynamic shared memory, stream and
the bytes of every parameter, the scratch pointers of newer Tritons included. This is the call a launch from C++ must
make (docs/gpu.md#launches).

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
def test_triton_launches_each_family_with_the_arguments_its_signature_gives(recording_driver, tmp_path):
    from gactx.kernels import aot

    launches, log = _launch(recording_driver, tmp_path)
    assert {launch["family"] for launch in launches} == set(aot.FAMILIES)
    recorded = [line for line in log if line.startswith("launch ")]
    functions = [line.split()[1] for line in log if line.startswith("function ")]
    assert functions == [launch["name"] for launch in launches]
    for launch, line in zip(launches, recorded, strict=True):
        head, _, params = line.partition(" params")
        grid = " ".join(map(str, launch["grid"]))
        expected = (
            f"launch grid {grid} block {launch['block']} 1 1 shared {launch['shared']} stream {launch['stream']:#x}"
        )
        assert head == expected, launch["family"]
        assert params.split() == launch["params"], launch["family"]  # every parameter, byte for byte
        assert all(size in (None, 0) for size in launch["scratch"]), "a kernel asks for global scratch memory"
