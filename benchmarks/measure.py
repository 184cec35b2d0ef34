"""Measurements of one training configuration: time a step, activation and peak memory, maximum batch.

On CUDA, memory comes from the caching allocator: activation memory is ``memory_allocated`` after the
forward pass minus before it (the loss is a scalar), peak memory is ``max_memory_allocated`` over the
step minus the memory held at its start (weights, gradients, optimizer state), so transient buffers of
the kernels count. On the CPU there is no allocator to ask: plain PyTorch's saved bytes are counted by a
saved-tensor hook of our own (unique storages, parameters left out) and gactx's by its accounting.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from gactx.controller.stats import counted_range, cover

__all__ = [
    "StepMemory", "count_saved_bytes", "cuda_step_memory", "median_step_seconds", "max_batch", "gpu_activities",
    "synchronize",
]  # fmt: skip


def count_saved_bytes(model: torch.nn.Module, forward: Callable[[], torch.Tensor]) -> tuple[int, torch.Tensor]:
    """Bytes plain PyTorch saves for backward during ``forward()``: each saved storage once, and of a view of
    data that lives anyway (a batch sliced from a dataset) the bytes it covers, parameters and buffers left
    out, as gactx counts (``counted_range``). And the result. Hooks installed inside ``forward``
    (checkpointing) hide what they save."""
    model_ptrs = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    ranges: dict[int, list] = {}
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        ptr = t.untyped_storage().data_ptr()
        if ptr not in model_ptrs:
            total += cover(ranges.setdefault(ptr, []), *counted_range(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    return total, out


class StepMemory:
    """CUDA allocator figures of one training step."""

    def __init__(self, activation_bytes: int, peak_bytes: int, static_bytes: int) -> None:
        self.activation_bytes = activation_bytes  # held between forward and backward
        self.peak_bytes = peak_bytes  # the step's peak above what was held at its start
        self.static_bytes = static_bytes  # held at the start: weights, gradients, optimizer state, data


def cuda_step_memory(forward: Callable[[], torch.Tensor], backward: Callable[[torch.Tensor], None]) -> StepMemory:
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = forward()
    torch.cuda.synchronize()
    after_forward = torch.cuda.memory_allocated()
    backward(loss)
    del loss
    torch.cuda.synchronize()
    return StepMemory(after_forward - start, torch.cuda.max_memory_allocated() - start, start)


def median_step_seconds(step: Callable[[], None], steps: int, warmup: int, cuda: bool) -> float:
    """Median wall time of ``step`` over ``steps`` runs after ``warmup`` (CUDA events on a GPU)."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            step()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        else:
            begin_s = time.perf_counter()
            step()
            times.append(time.perf_counter() - begin_s)
    return statistics.median(times)


def max_batch(fits: Callable[[int], bool], start: int, doublings: int = 16) -> tuple[int, list[tuple[int, bool]]]:
    """The largest batch size for which ``fits(batch)`` is True: doubling from ``start`` (at most
    ``doublings`` times), then bisection. Returns it (0 if even ``start`` does not fit) and every
    (batch, fitted) tried."""
    limit = start << doublings
    tried: list[tuple[int, bool]] = []

    def attempt(batch: int) -> bool:
        ok = fits(batch)
        tried.append((batch, ok))
        return ok

    lo, hi = 0, start
    while hi <= limit and attempt(hi):
        lo, hi = hi, hi * 2
    if hi > limit:
        return lo, tried
    while hi - lo > max(1, lo // 32):  # within ~3%: each try is a full training step
        mid = (lo + hi) // 2
        if attempt(mid):
            lo = mid
        else:
            hi = mid
    return lo, tried


def synchronize(device: str) -> None:
    """Wait for the GPU where ``device`` is one (nothing on a CPU)."""
    if device == "cuda":
        torch.cuda.synchronize()


def gpu_activities(fn: Callable[[], object], device: str) -> int | None:
    """GPU activities (kernels, memsets, copies) one call of ``fn`` starts, by ``torch.profiler``; None off a GPU."""
    if device != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.profiler.kineto_results.events() if e.device_type().name == "CUDA")
