"""gactx/memory.py: the peak of a region as the allocator sees it."""

import os

import pytest
import torch

import gactx
from tests.conftest import needs_cuda

MIB = 1 << 20


def _region(x):
    y = x * 2  # +4 MiB
    z = y + 1  # +4 MiB: the peak, 8 MiB
    del y  # -4 MiB
    w = z * 3  # +4 MiB: 8 MiB again
    return w.sum()  # w and z freed on return


def test_the_peak_counts_temporaries_not_what_is_left():
    x = torch.randn(1024, 1024)
    with gactx.PeakMemory("cpu") as meter:
        _region(x)
    assert 8 * MIB <= meter.peak < 8 * MIB + 64 * 1024
    assert meter.method == "profiler allocation events"


def _child(code: str, *unset: str):
    """``code`` run by a new Python process (its allocator, profiler and C++ log state its own), without the
    environment variables ``unset``: the finished process."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in unset}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)


def test_frees_of_older_tensors_count_where_their_size_is_known():
    """In a child process: the allocator keeps the sizes a profiler saw by address, and one that an earlier region of
    this process saw at the same address, freed outside any region, would size the unseen free (gactx/memory.py)."""
    code = (
        "import torch, gactx\n"
        f"MIB = {MIB}\n"
        "x = torch.randn(1024, 1024)  # allocated with no profiler running: its size is unknown to the meter\n"
        "with gactx.PeakMemory('cpu') as meter:\n"
        "    del x\n"
        "    y = torch.empty(MIB, dtype=torch.uint8)\n"
        "assert MIB <= meter.peak < MIB + 64 * 1024, ('an unseen free does not pay for the new 1 MiB', meter.peak)\n"
        "with gactx.PeakMemory('cpu'):\n"
        "    z = torch.randn(1024, 1024)  # allocated under a meter: its size is known from now on\n"
        "with gactx.PeakMemory('cpu') as meter:\n"
        "    del z  # -4 MiB\n"
        "    y = torch.empty(MIB, dtype=torch.uint8)  # +1 MiB: never above the start\n"
        "assert meter.peak == 0, meter.peak\n"
    )
    done = _child(code, "KINETO_LOG_LEVEL")
    assert done.returncode == 0, done.stderr


def test_peak_memory_returns_the_result():
    out, peak = gactx.peak_memory(lambda n: torch.ones(n).sum(), 1 << 20, device="cpu")
    assert out == 1 << 20 and 4 * MIB <= peak < 4 * MIB + 64 * 1024


def test_other_devices_are_refused():
    with pytest.raises(ValueError, match="measures cuda and cpu"):
        gactx.PeakMemory("meta")


@needs_cuda
def test_cuda_peak_is_the_allocators():
    x = torch.randn(1024, 1024, device="cuda")
    with gactx.PeakMemory("cuda") as meter:
        _region(x)
    assert 8 * MIB <= meter.peak < 9 * MIB


def test_the_cpu_meter_writes_nothing_to_stderr_but_what_the_region_writes():
    """Kineto prints lines of its own to the process's stderr as the profiler starts and stops; the meter takes those
    out (a child process: they are written from C++, to file descriptor 2)."""
    code = (
        "import sys, torch, gactx\n"
        "x = torch.randn(256, 256, requires_grad=True)\n"
        "for _ in range(2):\n"
        "    with gactx.PeakMemory('cpu') as meter:\n"
        "        (x * 2).sum().backward()\n"
        "        print('written by the region', file=sys.stderr)\n"
        "    assert meter.peak > 0\n"
    )
    done = _child(code, "KINETO_LOG_LEVEL")
    assert done.returncode == 0, done.stderr
    assert done.stderr == "written by the region\n" * 2


def test_the_cpu_meter_holds_back_a_cuda_builds_notice_that_it_found_no_gpu():
    """A CUDA build of torch on a machine with no GPU: Kineto logs "gpuGetDeviceCount failed with code 35" as the
    profiler starts, which a measure of CPU memory has no use for; the meter takes that line out and leaves the
    region's own (a child process: written to file descriptor 2, as Kineto writes it)."""
    code = (
        "import os, gactx\n"
        "from gactx.memory import _without_kineto_lines\n"
        "with _without_kineto_lines():\n"
        "    os.write(2, b'ERROR:2026-01-01 00:00:00 7:7 DeviceProperties.cpp:45] '\n"
        "                b'gpuGetDeviceCount failed with code 35\\n')\n"
        "    os.write(2, b'written by the region\\n')\n"
    )
    done = _child(code, "KINETO_LOG_LEVEL")
    assert done.returncode == 0, done.stderr
    assert done.stderr == "written by the region\n"


def test_the_cpu_meter_holds_back_the_allocators_notice_of_a_free_it_cannot_size():
    """A region that frees memory allocated before it (a batch, an earlier step's activations) made torch's CPU
    allocator log "Memory block of unknown size was allocated before the profiling started" to stderr; the meter
    holds back C++ log messages below ERROR inside the region, and sets the level back after it (a child process:
    the notice is written once a process)."""
    code = (
        "import sys, torch, gactx\n"
        "from gactx.memory import _cpp_log_flag\n"
        "level = None if _cpp_log_flag() is None else _cpp_log_flag().value\n"
        "for _ in range(2):\n"
        "    x = torch.randn(512, 512)\n"
        "    with gactx.PeakMemory('cpu') as meter:\n"
        "        del x\n"
        "        y = torch.randn(64, 64)\n"
        "    assert meter.peak >= 64 * 64 * 4\n"
        "assert level is None or _cpp_log_flag().value == level, 'the level is set back'\n"
    )
    done = _child(code, "KINETO_LOG_LEVEL", "TORCH_CPP_LOG_LEVEL")
    assert done.returncode == 0, done.stderr
    assert "unknown size" not in done.stderr and done.stderr == ""
