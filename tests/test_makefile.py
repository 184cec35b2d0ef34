"""The Makefile's ``torch`` target says which torch build it installs, from where and how big, before pip starts, and
takes ``TORCH_BUILD`` to choose (``PIP_INSTALL=echo``: the pip command is shown, not run)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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
    done = _torch(bare_python, "cpu")
    said, command = done.stdout.splitlines()
    assert done.returncode == 0 and "CPU build" in said and "190 MB" in said and "TORCH_BUILD=cuda" in said
    assert command == "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"


def test_the_cuda_build_is_said_with_its_size_before_pip_starts(bare_python):
    done = _torch(bare_python, "cuda")
    said, command = done.stdout.splitlines()
    assert done.returncode == 0 and "CUDA build" in said and "5 GB" in said and "TORCH_BUILD=cpu" in said
    assert command == "torch==2.13.0 numpy ninja"


def test_an_unknown_build_is_refused_and_an_installed_torch_is_kept(bare_python):
    done = _torch(bare_python, "gpu")
    assert done.returncode != 0 and "TORCH_BUILD=gpu is not one of auto, cpu, cuda" in done.stderr
    kept = _torch(sys.executable, "cuda")  # this process's Python has torch
    assert kept.returncode == 0 and kept.stdout.strip().endswith("is installed: kept")
