"""Run in a child process over the recording driver (tests/kernels/test_launch_record.py): compile one configuration of
each kernel family for sm_90 and launch it with known arguments through Triton's own launcher, then from C++
(gactx.kernels.native), and write what each launch was given as JSON (argv[1]), for the test to read against what the
driver recorded."""

import ctypes
import json
import os
import struct
import sys

import triton
import triton.runtime
from triton.backends.nvidia import driver as nvidia

from gactx.kernels import aot, native

PACK = {"i32": "<i", "u32": "<I", "i64": "<q", "u64": "<Q", "fp32": "<f", "i1": "<?", "u8": "<B", "i8": "<b"}


def main(out: str) -> None:
    recording = ctypes.CDLL(os.path.join(os.environ["TRITON_LIBCUDA_PATH"], "libcuda.so.1"))
    native.open_driver()  # libcuda.so.1 as the loader finds it: the recording driver
    utils = nvidia.CudaUtils()
    triton.runtime.driver.set_active(nvidia.CudaDriver())
    seen, launches = set(), []
    for spec in aot.specs(aot.FAMILIES, None, [256]):
        if spec.family in seen:
            continue
        seen.add(spec.family)
        source = aot.ast_source(spec)
        kernel, _ = aot._compile(source, 90, spec.options)
        md = kernel.metadata
        _, function, *_ = utils.load_binary(md.name, kernel.asm["cubin"], md.shared, 0)
        args, params = [], []  # every argument in order, as the JIT passes them; the parameters without constexprs
        for i, (name, kind) in enumerate(spec.signature.items()):
            if kind == "constexpr":
                args.append(spec.constexprs[name])
                continue
            pointer, whole = kind.startswith("*"), "fp" not in kind
            value = 0x7F00_0000_0000 + (i + 1) * 0x10_0000 if pointer else 7 + i if whole else 0.25 * i
            args.append(value)
            params.append(struct.pack("<Q", value) if pointer else struct.pack(PACK[kind], value))
        scratch = [getattr(md, f"{k}_scratch_size", None) for k in ("global", "profile")]
        params += [struct.pack("<Q", 0) for size in scratch if size is not None]  # no scratch: a null pointer each
        sizes = (ctypes.c_int * len(params))(*map(len, params))
        recording.recording_expect(len(params), sizes)
        grid, stream = (3 + len(launches), 2, 1), 0x5000 + len(launches)
        launcher = nvidia.CudaLauncher(source, md)
        launcher(*grid, stream, function, kernel.packed_metadata, None, None, None, *args)
        # The same call from C++: its own load of the cubin, then the parameters without constexprs, scratch as null.
        native_function = native.load(kernel)
        values = [a for a, t in zip(args, spec.signature.values(), strict=True) if t != "constexpr"]
        values += [0] * (len(params) - len(values))
        native.launch(native_function, grid, md, stream, native.kinds(spec.signature, md), values)
        launches.append({
            "family": spec.family, "name": md.name, "grid": grid, "block": md.num_warps * 32, "shared": md.shared,
            "stream": stream, "params": [p.hex() for p in params], "scratch": scratch,
        })  # fmt: skip
    with open(out, "w") as f:
        json.dump(launches, f)


if __name__ == "__main__":
    main(sys.argv[1])
