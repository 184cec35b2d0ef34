"""Run in a child process over the recording driver (tests/kernels/test_launch_record.py): for every configuration of
the kernels that native packers launch (gactx.kernels.native: the uniform scheme's quantize and dequantize, FewBit's
bins and their table's decoding; each dtype, width and rounding, with and without a rest, at groups of 256, and sizes
of 2**31 elements and more), pack a CPU tensor and unpack it with a packer under ``native.recording``, then make the
same two calls through Triton's own launcher with the same arguments, its kernels compiled from the specs that
gactx.kernels.aot lists. Writes JSON (argv[1]): for each configuration, its launches' parameter sizes in order."""

import ctypes
import itertools
import json
import os
import sys

import torch
import triton
import triton.runtime
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia import driver as nvidia

from gactx.kernels import aot, native
from gactx.kernels.schemes.uniform.dequantize import dequantize_launch
from gactx.kernels.schemes.uniform.quantize import quantize_launch
from gactx.kernels.specs import DTYPES, WHOLE
from gactx.kernels.tables import decode_table_launch, encode_bins_launch

GROUP, SEED = 256, (1 << 61) + 12345


class Launcher:
    """Triton's own launcher for the specs of gactx.kernels.aot, each compiled once for sm_90."""

    def __init__(self, recording: ctypes.CDLL) -> None:
        self.recording, self.utils = recording, nvidia.CudaUtils()
        self.specs = {(s.family, tuple(sorted(s.config.items()))): s for s in aot.specs(FAMILIES, None, [GROUP])}
        self.compiled = {}

    def sizes(self, family: str, config: dict, wide: bool) -> list[int]:
        spec = self.spec(family, config, wide)
        kernel, _ = self.compile(spec)
        sizes = [8 if t.startswith("*") else int(t[1:]) // 8 for t in spec.signature.values() if t != "constexpr"]
        scratch = [getattr(kernel.metadata, f"{k}_scratch_size", None) for k in ("global", "profile")]
        return sizes + [8 for size in scratch if size is not None]

    def spec(self, family: str, config: dict, wide: bool):
        spec = self.specs[(family, tuple(sorted(config.items())))]
        if wide:  # 2**31 elements and more: n as int64, as the JIT types it by its value
            signature = {k: "i64" if k == "n" else v for k, v in spec.signature.items()}
            spec = aot.KernelSpec(spec.family, spec.config, spec.kernel, signature, spec.constexprs, spec.options,
                                  spec.elements, spec.bytes_per_element, spec.exact, spec.wide)  # fmt: skip
        return spec

    def compile(self, spec):
        key = (spec.family, tuple(sorted(spec.config.items())), tuple(spec.signature.items()))
        if key not in self.compiled:
            kernel = triton.compile(aot.ast_source(spec), target=GPUTarget("cuda", 90, 32), options=dict(spec.options))
            md = kernel.metadata
            _, function, *_ = self.utils.load_binary(md.name, kernel.asm["cubin"], md.shared, 0)
            self.compiled[key] = kernel, function
        return self.compiled[key]

    def __call__(self, family: str, config: dict, wide: bool, programs: int, values: list) -> None:
        """The launch of the spec with ``values`` (the parameters in order), its constexprs from the spec."""
        spec = self.spec(family, config, wide)
        kernel, function = self.compile(spec)
        given = iter(values)
        args = [spec.constexprs[k] if t == "constexpr" else next(given) for k, t in spec.signature.items()]
        launcher = nvidia.CudaLauncher(aot.ast_source(spec), kernel.metadata)
        launcher(programs, 1, 1, 0, function, kernel.packed_metadata, None, None, None, *args)


FAMILIES = ("quantize", "dequantize", "encode_bins", "decode_table")


def expect(recording, name: str, sizes: list[int]) -> None:
    recording.recording_expect_function(name.encode(), len(sizes), (ctypes.c_int * len(sizes))(*sizes))


def uniform(launch: Launcher, recording, name: str, bits: int, stochastic: bool, n: int) -> dict:
    dtype, rest, wide = DTYPES[name], n % WHOLE != 0, n >= 2**31
    x = torch.empty(n, dtype=dtype)
    packer = native.quantize_packer(x, bits, GROUP, stochastic)
    q_config = dict(dtype=name, bits=bits, group=GROUP, stochastic=stochastic, rest=rest)
    d_config = dict(dtype=name, bits=bits, group=GROUP, rest=rest)
    q_sizes, d_sizes = launch.sizes("quantize", q_config, wide), launch.sizes("dequantize", d_config, wide)
    expect(recording, "_quantize_kernel", q_sizes)
    expect(recording, "_dequantize_kernel", d_sizes)
    handle = packer(x, SEED)
    groups = -(-n // GROUP)
    codes = handle.data.data_ptr()
    meta = codes + -(-(groups * GROUP * bits // 8) // 16) * 16
    programs, full, _ = quantize_launch(n, dtype, bits, GROUP, stochastic)
    launch("quantize", q_config, wide, programs, [x.data_ptr(), codes, meta, n, SEED, full])
    del x  # freed: the handle decodes
    out = handle.unpack()
    programs, full, _ = dequantize_launch(n, dtype, bits, GROUP)
    launch("dequantize", d_config, wide, programs, [codes, meta, out.data_ptr(), n, full])
    return {"config": q_config | {"n": n}, "sizes": [q_sizes, d_sizes]}


def bins(launch: Launcher, recording, name: str, bits: int, n: int) -> dict:
    dtype, rest, wide = DTYPES[name], n % WHOLE != 0, n >= 2**31
    x = torch.empty(n, dtype=dtype)
    edges = torch.linspace(-2, 2, (1 << bits) - 1).to(dtype)
    table = torch.linspace(0, 1, 1 << bits).to(dtype)
    packer = native.bins_packer(x, edges, bits, table)
    e_config = dict(dtype=name, bits=bits, rest=rest)
    d_config = dict(width=dtype.itemsize * 8, bits=bits, rest=rest)
    e_sizes, d_sizes = launch.sizes("encode_bins", e_config, wide), launch.sizes("decode_table", d_config, wide)
    expect(recording, "_encode_bins_kernel", e_sizes)
    expect(recording, "_decode_table_kernel", d_sizes)
    handle = packer(x, SEED)
    codes = handle.data.data_ptr()
    programs, full, _ = encode_bins_launch(n, bits, edges.numel(), dtype)
    launch("encode_bins", e_config, wide, programs, [x.data_ptr(), edges.data_ptr(), codes, n, full])
    del x
    out = handle.unpack()
    programs, full, _ = decode_table_launch(n, bits)
    launch("decode_table", d_config, wide, programs, [codes, table.data_ptr(), out.data_ptr(), n, full])
    return {"config": e_config | {"n": n, "family": "bins"}, "sizes": [e_sizes, d_sizes]}


def main(out: str) -> None:
    library = os.path.join(os.environ["TRITON_LIBCUDA_PATH"], "libcuda.so.1")
    recording = ctypes.CDLL(library)
    triton.runtime.driver.set_active(nvidia.CudaDriver())
    launch, done = Launcher(recording), []
    with native.recording(library):
        for name, bits, stochastic, n in itertools.product(DTYPES, (1, 2, 4, 8), (False, True), (WHOLE, WHOLE + 1)):
            done.append(uniform(launch, recording, name, bits, stochastic, n))
        for name, bits, n in itertools.product(DTYPES, (2, 4, 8), (WHOLE, WHOLE + 1)):
            done.append(bins(launch, recording, name, bits, n))
        done.append(uniform(launch, recording, "bf16", 4, True, 2**31 + 1))  # n as int64
        done.append(bins(launch, recording, "fp16", 8, 2**31 + 1))
        problems = dict(native._problem)
    with open(out, "w") as f:
        json.dump({"configurations": done, "problems": problems}, f)


if __name__ == "__main__":
    main(sys.argv[1])
