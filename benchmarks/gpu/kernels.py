"""Arm 1: ``gactx.quantize`` and ``gactx.dequantize`` at the sizes activations have, against ``torch.clone``.

For each dtype (float32, bfloat16) and size (1 to 256 MiB; tiny: 64 and 256 KiB), one input: its clone time,
then at 2, 4 and 8 bits the time of quantize and dequantize (``triton.testing.do_bench``'s median on a GPU,
the CPU timer of the kernels benchmark elsewhere), GB/s as the kernels benchmark counts them, the host
microseconds a call costs (a run of calls timed on the host while the GPU is kept busy, so that no call waits
for it: what a call costs where steps are short) and the kernel launches one call makes (``torch.profiler``'s
GPU activities: kernels, memsets and copies; none on a CPU).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch

import gactx
from benchmarks import throughput
from benchmarks.gpu.harness import Deadline, emit
from benchmarks.measure import gpu_activities

__all__ = ["run", "SIZES_MIB", "TINY_SIZES_MIB", "BITS"]

SIZES_MIB = (1, 4, 16, 64, 256)
TINY_SIZES_MIB = (0.0625, 0.25)
BITS = (2, 4, 8)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GROUP = 256
HOST_CALLS = 50  # calls timed on the host per figure: their mean
# torch.cuda._sleep's cycles: about 50 ms at H100 clocks (1.7-2 GHz), 10 times what 50 calls of 100 us take to queue
BUSY_CYCLES = 100_000_000
CASE_S = 1.5  # a case's time on an H100 (two do_bench runs, host timing, profiler): start none with less left


def _timer(device: str) -> Callable[[Callable[[], object]], float]:
    if device == "cuda":
        import triton.testing

        return functools.partial(triton.testing.do_bench, warmup=10, rep=40, return_mode="median")
    return functools.partial(throughput.cpu_time_ms, repeats=3)


def host_us(fn: Callable[[], object], device: str) -> tuple[float, bool]:
    """Mean host microseconds a call of ``fn`` takes when it never waits for the GPU, and whether the GPU was
    still busy when the last call returned (else the figure may hold waits: it is flagged)."""
    fn()
    busy = True
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda._sleep(BUSY_CYCLES)  # the GPU is busy for longer than the calls below take to enqueue
        slept = torch.cuda.Event()
        slept.record()
    start = time.perf_counter()
    for _ in range(HOST_CALLS):
        fn()
    spent = time.perf_counter() - start
    if device == "cuda":
        busy = not slept.query()
        torch.cuda.synchronize()
    return spent / HOST_CALLS * 1e6, busy


def launches(fn: Callable[[], object], device: str) -> int | None:
    """GPU activities one call of ``fn`` starts, after a call that compiles and allocates; None on a CPU."""
    if device != "cuda":
        return None
    fn()
    torch.cuda.synchronize()
    return gpu_activities(fn, device)


def run(device: str, tiny: bool, deadline: Deadline) -> None:
    timer = _timer(device)
    sizes = TINY_SIZES_MIB if tiny else SIZES_MIB
    for name, dtype in DTYPES.items():
        for size_mib in sizes:
            if not deadline.allows(CASE_S * len(BITS)):
                emit({"id": f"kernels/{name}/{size_mib:g}", "kind": "skipped", "arm": "kernels",
                      "reason": "time limit"})  # fmt: skip
                continue
            x = torch.randn(int(size_mib * throughput.MIB) // dtype.itemsize, dtype=dtype, device=device)
            in_bytes = x.numel() * x.element_size()
            clone_ms = timer(x.clone)
            clone_us, busy = host_us(x.clone, device)
            base = {"arm": "kernels", "kind": "kernel", "dtype": name, "size_mib": size_mib, "clone_ms": clone_ms,
                    "clone_gbps": throughput.gbps(2 * in_bytes, clone_ms), "clone_host_us": clone_us}  # fmt: skip
            for bits in BITS:
                quantize = functools.partial(gactx.quantize, x, bits, GROUP, seed=throughput.SEED)
                q = quantize()
                dequantize = functools.partial(gactx.dequantize, q)
                quantize_ms, dequantize_ms = timer(quantize), timer(dequantize)
                moved = in_bytes + q.nbytes
                (quantize_us, busy_q), (dequantize_us, busy_d) = host_us(quantize, device), host_us(dequantize, device)
                row = base | {
                    "id": f"kernels/{name}/{size_mib:g}/{bits}", "bits": bits, "kept": q.nbytes / in_bytes,
                    "quantize_ms": quantize_ms, "dequantize_ms": dequantize_ms,
                    "quantize_gbps": throughput.gbps(moved, quantize_ms),
                    "dequantize_gbps": throughput.gbps(moved, dequantize_ms),
                    "quantize_host_us": quantize_us, "dequantize_host_us": dequantize_us,
                    "host_while_busy": busy and busy_q and busy_d,
                    "quantize_launches": launches(quantize, device),
                    "dequantize_launches": launches(dequantize, device),
                }  # fmt: skip
                row["quantize_vs_clone"] = row["quantize_gbps"] / row["clone_gbps"]
                row["dequantize_vs_clone"] = row["dequantize_gbps"] / row["clone_gbps"]
                emit(row)
                del q
            del x
            if device == "cuda":
                torch.cuda.empty_cache()
