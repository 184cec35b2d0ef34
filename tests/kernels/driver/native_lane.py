"""Run in a child process over the recording driver (tests/kernels/test_launch_record.py): a model's replayed saves
packed and unpacked by native launches in the eager lane (gactx.kernels.native under ``recording``: CPU tensors, the
kernels compiled for sm_90), against the same model on the C++ kernels. Writes JSON (argv[1]): what a step launched,
the Python calls of gactx's a step made, the records of both, and the handles left alive."""

import ctypes
import json
import os
import sys
from pathlib import Path

import torch

import gactx
from gactx.controller.compiled import INLINE
from gactx.kernels import cpu, native

GACTX = str(Path(gactx.__file__).resolve().parent)
WIDTH, BLOCKS = 64, 8


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[m for _ in range(BLOCKS) for m in (torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU())])


def step(net, controller, x) -> None:
    net(x).sum().backward()
    net.zero_grad(set_to_none=True)
    controller.iterate()


def counted_step(forward, controller, x) -> int:
    """One step, and the calls of gactx's Python functions it made (in this thread)."""
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        if event == "call" and frame.f_code.co_filename.startswith(GACTX):
            calls += 1

    sys.setprofile(count)
    try:
        step(forward, controller, x)
    finally:
        sys.setprofile(None)
    return calls


def records(controller) -> list:
    return [(r.op, r.bits, r.original_bytes, r.packed_bytes, r.compressed) for r in controller.records]


def compiled(library: str, log: Path, x: torch.Tensor) -> dict:
    """The same model compiled: its graphs' saves stored by native launches from the C++ ops (one call each way)."""
    net = model()
    controller = gactx.Controller(net, level="L1")
    forward = torch.compile(net)
    with native.recording(library), controller:
        for _ in range(3):
            step(forward, controller, x)
        before = len(log.read_text().splitlines())
        calls = counted_step(forward, controller, x)
        lines = log.read_text().splitlines()[before:]
        # A step captured by CUDA graphs (the recording driver's streams say so): each quantize reads its seed on the
        # device, advanced by a launch before it.
        recording = ctypes.CDLL(library)
        scratch = native._kernel("advance_seed", (torch.float32, False, ()), x.device, native._target(x))[3]
        for name, sizes in (("_advance_seed_kernel", [8]), ("_quantize_kernel", [8, 8, 8, 4, 8, 4])):
            sizes = sizes + [8] * scratch
            recording.recording_expect_function(name.encode(), len(sizes), (ctypes.c_int * len(sizes))(*sizes))
        before = len(log.read_text().splitlines())
        recording.recording_capture(1)
        try:
            step(forward, controller, x)
        finally:
            recording.recording_capture(0)
        captured = [line for line in log.read_text().splitlines()[before:] if line.startswith("launch ")]
    names = [line.split(" function ")[1].split(":")[1].split()[0] for line in lines if line.startswith("launch ")]
    return {
        "launches": names, "python_calls": calls, "compressed": sum(r.compressed for r in controller.records),
        "report": controller.report().splitlines()[-1], "captured": captured,
        "uncaptured_quantize": next(line for line in lines if "_quantize_kernel" in line),
    }  # fmt: skip


def main(out: str) -> None:
    library = os.path.join(os.environ["TRITON_LIBCUDA_PATH"], "libcuda.so.1")
    log = Path(os.environ["GACTX_RECORDING_DRIVER_LOG"])
    x = torch.randn(WIDTH, WIDTH)
    reference, native_net = model(), model()
    on_cpu = gactx.Controller(reference, level="L1")
    with on_cpu:
        for _ in range(3):
            step(reference, on_cpu, x)
    launched = gactx.Controller(native_net, level="L1")
    result = {}
    with native.recording(library), launched:
        for _ in range(3):
            step(native_net, launched, x)
        alive = cpu.built.Saved.alive()
        before = len(log.read_text().splitlines())
        calls = counted_step(native_net, launched, x)
        lines = log.read_text().splitlines()[before:]
        result["alive_after"] = cpu.built.Saved.alive() - alive
        packer = native.quantize_packer(x, 4, 256, True)
        unaligned = torch.empty(WIDTH * WIDTH + 1)[1:]
        result["unaligned"] = [packer.accepts(unaligned), packer(unaligned, 7) is None, packer.accepts(x)]
    # (a torch older than 2.10 gives saved-tensor hooks no view of compiled graphs: nothing of theirs to launch)
    result["compiled"] = compiled(library, log, x) if INLINE else None
    result["launches"] = [line.split(" params")[0] for line in lines if line.startswith("launch ")]
    result["loads"] = [line for line in lines if line.startswith(("load", "function"))]
    result["python_calls"] = calls
    result["native"], result["cpu"] = records(launched), records(on_cpu)
    result["problems"] = {k: v for k, v in native._problem.items() if v}
    result["report"] = launched.report().splitlines()[-1]
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
