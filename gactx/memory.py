"""Peak memory of a region of code, as the memory allocator sees it: what decides an out-of-memory error.

``gactx`` counts the bytes its handles hold (``Controller.memory_stats()``); a step's peak also holds the
temporaries of every op, of the compression itself, and what the step keeps from the one before. This is
the number users compare::

    with gactx.PeakMemory() as meter:          # the default device, or PeakMemory("cuda:1")
        loss = model(x).loss
        loss.backward()
    print(meter.peak)                          # bytes above what was allocated when the region began

- CUDA: the caching allocator's peak (``torch.cuda.max_memory_allocated``) over the region, minus what was
  allocated at its start. Its peak statistic is reset on entry.
- CPU: PyTorch's CPU allocator has no peak statistic. Every allocation and free of the region is recorded
  with ``torch.profiler`` (``profile_memory=True``) and the running sum, in time order, gives the peak (at
  least 0). A free of memory allocated before the region counts only where the allocator knows its size,
  that is where it was allocated while a profiler ran (an earlier meter): begin the region after what the
  step frees first (``optimizer.zero_grad()``), so that both devices measure the same thing. The allocator keeps
  those sizes by address and forgets one only at a free it sees while profiling: a block an earlier region saw
  allocated and that was freed outside any region leaves its size behind, and a block allocated later at the same
  address (outside a region) and freed inside one is counted with that size (in a loop of such regions, 5 of 20
  peaks read 0 where 1 MiB was allocated). The profiler
  costs time, not memory: time a step without the meter. The profiler's library (Kineto) writes lines of its own
  to the process's stderr as it starts and stops (``USDT: ... profiler_start``, ``STAGE: ...``): those are taken
  out, and anything else written there meanwhile is passed on. Inside the region torch's C++ log messages below
ERROR are held back (``FLAGS_caffe2_log_level``, restored on exit): the allocator's "Memory block of unknown size was
allocated before the profiling started" notice, written when the region frees memory allocated before it, is one
(Python warnings are not affected).

Nothing here reads a tensor: no host synchronization beyond the one ``torch.cuda.synchronize`` on exit.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import sys
import tempfile
from collections.abc import Iterator

import torch

__all__ = ["PeakMemory", "peak_memory"]


class PeakMemory:
    """Measures the peak bytes allocated on ``device`` during a ``with`` block, above what was allocated at
    its start (see the module docstring). After the block: ``peak`` (bytes), ``method`` (what measured
    it). Not reentrant; one at a time on a device."""

    def __init__(self, device: str | torch.device | None = None) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type not in ("cuda", "cpu"):
            raise ValueError(f"PeakMemory measures cuda and cpu devices, not {self.device.type!r}")
        self.peak: int | None = None
        self.method = "cuda caching allocator" if self.device.type == "cuda" else "profiler allocation events"
        self._start = 0
        self._profiler = None

    def __enter__(self) -> PeakMemory:
        self.peak = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            from torch.profiler import ProfilerActivity, profile

            self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._log_level = _set_cpp_log_level(_CPP_ERROR)
            with _without_kineto_lines():
                self._profiler.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._start
            return
        profiler, self._profiler = self._profiler, None
        try:
            with _without_kineto_lines():
                profiler.__exit__(*exc)
        finally:
            _set_cpp_log_level(self._log_level)
        self.peak = _running_peak(profiler.profiler.kineto_results.events())


_CPP_ERROR = 2  # c10's log severities: INFO 0, WARNING 1, ERROR 2, FATAL 3


def _set_cpp_log_level(level: int | None) -> int | None:
    """Set c10's ``FLAGS_caffe2_log_level`` (the least severity its ``LOG`` writes) and return what it was; ``None``
    (and nothing set) where this torch's c10 library does not export it."""
    flag = _cpp_log_flag()
    if flag is None or level is None:
        return None
    old, flag.value = flag.value, level
    return old


@functools.cache
def _cpp_log_flag() -> ctypes.c_int | None:
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", _C10_LIBRARY))
        return ctypes.c_int.in_dll(lib, "FLAGS_caffe2_log_level")
    except (OSError, ValueError, AttributeError):
        return None


_C10_LIBRARY = {"win32": "c10.dll", "darwin": "libc10.dylib"}.get(sys.platform, "libc10.so")


# What Kineto writes to stderr as a profiler starts and stops, one after another, not always with a newline between;
# and, under a CUDA build of torch on a machine with no GPU, the error line of its look for GPUs (whatever prefix its
# logger gives it), which a measure of CPU memory has no use for.
_KINETO_LINE = re.compile(
    r"(?:STAGE|USDT):\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \w+\.cpp:\d+\] "
    r"(?:profiler_start|profiler_stop|Completed Stage: [A-Za-z ]+?)(?=STAGE:|USDT:|\n|$)\n?"
    r"|^[^\n]*gpuGetDeviceCount failed with code \d+[^\n]*\n?",
    re.MULTILINE,
)


@contextlib.contextmanager
def _without_kineto_lines() -> Iterator[None]:
    """The process's stderr (file descriptor 2: Kineto writes from C++) into a temporary file for the block; then
    what was written there, less Kineto's lines, to ``sys.stderr``."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no file descriptor 2 (an embedded interpreter): leave it
        yield
        return
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            rest = _KINETO_LINE.sub("", caught.read().decode(errors="replace"))
            if rest:
                sys.stderr.write(rest)


def _running_peak(events) -> int:
    """The largest running sum of the CPU allocations (positive ``nbytes``) and frees (negative) in ``events``,
    in time order, and at least 0."""
    memory = [(e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]" and e.device_type().name == "CPU"]
    memory.sort(key=lambda pair: pair[0])  # events of several threads, each list in its own order
    total = peak = 0
    for _, nbytes in memory:
        total += nbytes
        peak = max(peak, total)
    return peak


def peak_memory(fn, *args, device: str | torch.device | None = None, **kwargs) -> tuple[object, int]:
    """``fn(*args, **kwargs)`` under a :class:`PeakMemory`: ``(its result, peak bytes)``."""
    with PeakMemory(device) as meter:
        out = fn(*args, **kwargs)
    return out, meter.peak
