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

import gc
import time

from benchmarks.gpu import training
from benchmarks.gpu.harness import Deadline, emit
from benchmarks.gpu.profiles import device_profile, python_profile
from benchmarks.measure import synchronize
from benchmarks.methods import Method
from benchmarks.run import train_step

__all__ = ["run"]

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
    """One adaptation under ``torch.profiler``: wall time, the device's busy time, launches a pass, the top ops."""
    a, fields = device_profile(lambda: controller.adapt(backprop), device)
    launches = fields.pop("launches")
    return {"seconds": a.seconds, "passes": a.passes, **fields, "launches_a_pass": launches / max(a.passes, 1)}


def _python(controller, backprop) -> dict:
    """One adaptation under ``cProfile``: the functions with the most time of their own, in ms."""
    a, fields = python_profile(lambda: controller.adapt(backprop))
    return {"seconds": a.seconds, "passes": a.passes, **fields}
