"""One call under the profilers: where its time goes on this device (the adaptation arm's rows, and the training arms'
step profiles).

- :func:`device_profile`: the call under ``torch.profiler`` (host activities, and the device's on a GPU): its wall time,
  the device's busy time (its kernels, copies and memsets, summed) and that time's share of the wall, the kernel
  launches, and the ops with the most host time and the most device time of their own;
- :func:`python_profile`: the call under ``cProfile``: the Python functions with the most time of their own, and
  gactx's own functions' time and those with the most (all of gactx's host work is Python or the ops it calls).

Each runs the call once, after a full garbage collection (whose cost otherwise falls inside whichever call made it
due), and returns the call's result and the row's fields.
"""

from __future__ import annotations

import cProfile
import gc
import pstats
import time
from collections.abc import Callable
from pathlib import Path

import gactx
from benchmarks.measure import synchronize

__all__ = ["TOP", "device_profile", "python_profile"]

TOP = 12  # ops and functions listed in a row
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")  # the runtime's and the driver's calls
GACTX = str(Path(gactx.__file__).resolve().parent)


def device_profile(call: Callable[[], object], device: str) -> tuple[object, dict]:
    """``call()`` under ``torch.profiler`` (see the module docstring): its result, and the row's fields."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    gc.collect()
    begin = time.perf_counter()
    with profile(activities=activities) as prof:
        result = call()
        synchronize(device)
    wall = time.perf_counter() - begin
    events = prof.key_averages()
    on_device = [e for e in events if getattr(e, "self_device_time_total", 0) > 0]
    busy_us = sum(e.self_device_time_total for e in on_device)
    by_host = sorted(events, key=lambda e: -e.self_cpu_time_total)[:TOP]
    by_device = sorted(on_device, key=lambda e: -e.self_device_time_total)[:TOP]
    return result, {
        "wall_s_profiled": wall,
        "device_busy_s": busy_us / 1e6,
        "device_busy_share": busy_us / 1e6 / wall if wall > 0 else None,
        "launches": sum(e.count for e in events if e.key in LAUNCHES),
        "top_host_ops": [(e.key, e.count, round(e.self_cpu_time_total / 1e3, 2)) for e in by_host],
        "top_device_ops": [(e.key, e.count, round(e.self_device_time_total / 1e3, 2)) for e in by_device],
    }


def python_profile(call: Callable[[], object]) -> tuple[object, dict]:
    """``call()`` under ``cProfile`` (see the module docstring): its result, and the row's fields (times in ms)."""
    gc.collect()
    profiler = cProfile.Profile()
    begin = time.perf_counter()
    profiler.enable()
    result = call()
    profiler.disable()
    wall = time.perf_counter() - begin
    by_own = sorted(pstats.Stats(profiler).stats.items(), key=lambda item: -item[1][2])
    mine = [item for item in by_own if item[0][0].startswith(GACTX)]
    return result, {
        "wall_s_cprofiled": wall,
        "gactx_python_ms": round(sum(item[1][2] for item in mine) * 1e3, 2),
        "top_python": _listed(by_own[:TOP]),
        "top_gactx": _listed(mine[:TOP]),
    }


def _listed(items) -> list[tuple[str, int, float]]:
    """cProfile's entries as (file:line(function), calls, ms of their own)."""
    return [(f"{path.rsplit('/', 1)[-1]}:{line}({name})", calls, round(tottime * 1e3, 2))
            for (path, line, name), (_, calls, tottime, _, _) in items]  # fmt: skip
