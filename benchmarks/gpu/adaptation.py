"""Arm 7, ``adaptation``: where an adaptation's time goes on this device.

The ``resnet50`` arm's model and batch (bf16 autocast, channels_last) at L2.2, with its 8-image closure (the methods'
sub-batch): two training steps (the first adapts), then three adaptations after the first, each after a full
garbage collection: one timed alone, one under ``torch.profiler`` (host and device activities), one under
``cProfile``. On the first H200 run the first adaptation took 100 passes and 5.5 s, about 55 ms a pass of 8
images: far more than their compute. The rows say whether that is the host's time or the device's:

- ``adaptation/timed``: seconds, passes (by part, and those run backward from the probed nodes), seconds a pass;
- ``adaptation/profile``: the wall time under the profiler against the device's busy time (its kernels, copies and
  memsets, summed), kernel launches a pass, and the ops with the most host time and the most device time;
- ``adaptation/python``: the Python functions with the most time of their own (``cProfile``; all of gactx's
  host work is Python or the ops it calls).

Every row is emitted as soon as it is measured; the arm stops where its deadline would cut the next part.
"""

from __future__ import annotations

import cProfile
import gc
import pstats
import time

from benchmarks.gpu import training
from benchmarks.gpu.harness import Deadline, emit
from benchmarks.measure import synchronize
from benchmarks.methods import Method
from benchmarks.run import train_step

__all__ = ["run"]

TOP = 12  # ops and functions listed in a row
LEVEL = "L2.2"


def run(device: str, tiny: bool, deadline: Deadline) -> None:
    arm = training.ARMS["resnet50"]
    w, (inputs, target), optimizer = training._prepare(arm, "resnet50", "tiny" if tiny else arm.size, device, tiny)
    method = Method(LEVEL, w, precision=arm.precision)
    controller = method.controller
    base = {"arm": "adaptation", "kind": "adaptation", "model": w.name, "level": LEVEL, "batch": inputs[0].shape[0]}

    begin = time.perf_counter()
    train_step(method, optimizer, inputs, target)  # the first adaptation runs in it
    synchronize(device)
    first = controller.last_adaptation
    train_step(method, optimizer, inputs, target)
    synchronize(device)
    emit({"id": "adaptation/first", **base, "seconds": first.seconds, "passes": first.passes,
          "partial_passes": first.partial_passes, "steps_s": time.perf_counter() - begin})  # fmt: skip
    later = method.backprop(inputs, target)
    if not deadline.allows(4 * first.seconds + 5):
        return
    gc.collect()
    a = controller.adapt(later)
    synchronize(device)
    emit({"id": "adaptation/timed", **base, "seconds": a.seconds, "passes": a.passes,
          "partial_passes": a.partial_passes, "s_a_pass": a.seconds / max(a.passes, 1),
          "passes_by_part": {part: list(v) for part, v in a.passes_by_part.items()}})  # fmt: skip
    if deadline.allows(3 * a.seconds + 5):
        emit({"id": "adaptation/profile", **base, **_profiled(controller, later, device)})
    if deadline.allows(3 * a.seconds + 5):
        emit({"id": "adaptation/python", **base, **_python(controller, later)})
    method.close()


def _profiled(controller, backprop, device: str) -> dict:
    """One adaptation under ``torch.profiler``: wall time, the device's busy time, launches, the top ops."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    gc.collect()
    begin = time.perf_counter()
    with profile(activities=activities) as prof:
        a = controller.adapt(backprop)
        synchronize(device)
    wall = time.perf_counter() - begin
    events = prof.key_averages()
    on_device = [e for e in events if getattr(e, "self_device_time_total", 0) > 0]
    busy_us = sum(e.self_device_time_total for e in on_device)
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    by_host = sorted(events, key=lambda e: -e.self_cpu_time_total)[:TOP]
    by_device = sorted(on_device, key=lambda e: -e.self_device_time_total)[:TOP]
    return {
        "seconds": a.seconds, "passes": a.passes, "wall_s_profiled": wall, "device_busy_s": busy_us / 1e6,
        "device_busy_share": busy_us / 1e6 / wall if wall > 0 else None,
        "launches_a_pass": launches / max(a.passes, 1),
        "top_host_ops": [(e.key, e.count, round(e.self_cpu_time_total / 1e3, 2)) for e in by_host],
        "top_device_ops": [(e.key, e.count, round(e.self_device_time_total / 1e3, 2)) for e in by_device],
    }  # fmt: skip


def _python(controller, backprop) -> dict:
    """One adaptation under ``cProfile``: the functions with the most time of their own, in ms."""
    gc.collect()
    profiler = cProfile.Profile()
    profiler.enable()
    a = controller.adapt(backprop)
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    own = sorted(stats.items(), key=lambda item: -item[1][2])[:TOP]
    return {
        "seconds": a.seconds, "passes": a.passes,
        "top_python": [(f"{path.rsplit('/', 1)[-1]}:{line}({name})", calls, round(tottime * 1e3, 2))
                       for (path, line, name), (_, calls, tottime, _, _) in own],
    }  # fmt: skip
