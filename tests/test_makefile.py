"""The Makefile's ``torch`` target says which torch build it installs, from where and how big, before pip starts, and
takes ``TORCH_BUILD`` to choose (``PIP_INSTALL=echo``: the pip command is shown, not run)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gactx import _torch_build

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> str:
    """A Python with no torch: a venv without pip."""
    venv = tmp_path_factory.mktemp("bare")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    return str(venv / "bin" / "python")


def _torch(python: str, build: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "-s", "torch", f"PYTHON={python}", "PIP_INSTALL=echo", f"TORCH_BUILD={build}"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_the_cpu_build_is_said_with_its_index_and_size_then_installed_from_that_index(bare_python):
    done = _torch(bare_python, "cpu")  # a Python with no pip: make says what it expects, not what pip would take
    why, said, command = done.stdout.splitlines()
    assert done.returncode == 0 and why == "torch: TORCH_BUILD=cpu"
    assert "CPU build" in said and "190 MB" in said and "TORCH_BUILD=cuda" in said
    assert command == "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"


def test_the_cuda_build_is_said_with_its_size_before_pip_starts(bare_python):
    done = _torch(bare_python, "cuda")
    why, said, command = done.stdout.splitlines()
    assert done.returncode == 0 and why == "torch: TORCH_BUILD=cuda"
    assert "CUDA build" in said and "5 GB" in said and "TORCH_BUILD=cpu" in said
    assert command == "torch==2.13.0 numpy ninja"


def _report(version: str, url: str, requires: list[str]) -> dict:
    return {"install": [{"metadata": {"name": "torch", "version": version, "requires_dist": requires},
                         "download_info": {"url": url}}]}  # fmt: skip


def test_what_pip_would_take_is_said_from_its_report():
    """gactx/_torch_build.py reads pip's --dry-run report of torch alone: the build from the version's local label and
    the NVIDIA packages torch requires on this platform, the source, and the wheel's size."""
    cpu = _report("2.13.0+cpu", "file:///opt/wheels/torch-2.13.0%2Bcpu-cp311-cp311-manylinux_2_28_x86_64.whl", [])
    assert _torch_build.describe(cpu, 183 * 2**20) == (
        f"installing torch 2.13.0+cpu, CPU build, from a local wheel in /opt/wheels: 183 MiB. {_torch_build.CHOOSE}."
    )
    marker = '; platform_system == "Linux" and platform_machine == "x86_64"'
    cuda = _report(
        "2.9.1", "https://files.pythonhosted.org/packages/56/be/torch-2.9.1-cp311-cp311-manylinux_2_28_x86_64.whl",
        ["filelock", f"nvidia-cublas-cu12==12.8.4.1{marker}", f"nvidia-nccl-cu12==2.27.5{marker}", "triton==3.5.1"],
    )  # fmt: skip
    said = _torch_build.describe(cuda, 858 * 2**20, machine="x86_64", system="Linux")
    assert said.startswith("installing torch 2.9.1, CUDA build, from files.pythonhosted.org: 858 MiB, and its 2 ")
    assert "several GB more" in said and said.endswith(f"{_torch_build.CHOOSE}.")
    # the same wheel's NVIDIA packages are for x86_64 Linux only: on aarch64 the build is a CPU one
    arm = _torch_build.describe(cuda, None, machine="aarch64", system="Linux")
    assert "CPU build" in arm and "unknown size" in arm and "nvidia" not in arm


def test_an_unknown_build_is_refused_and_an_installed_torch_is_kept(bare_python):
    done = _torch(bare_python, "gpu")
    assert done.returncode != 0 and "TORCH_BUILD=gpu is not one of auto, cpu, cuda" in done.stderr
    kept = _torch(sys.executable, "cuda")  # this process's Python has torch
    assert kept.returncode == 0 and kept.stdout.strip().endswith("is installed: kept")
