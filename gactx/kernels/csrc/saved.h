// A replayed save's handle, made and read in one call each way (saved.cpp; gactx/controller/replay.py): what the pack
// hook returns for a CPU tensor that the uniform scheme's codes or FewBit's bins store, and decodes on unpack. It does
// what the pack path's Python handle (store.Packed) does for such a save, without a Python object a field.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include "launch.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

namespace gactx {

using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
using StrongImpl = c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

// The kernels of one replayed save's encoding and decoding where Triton compiled them and C++ launches them (a CUDA
// tensor, or a CPU tensor under the recording driver of the tests): its size, dtype and device are the replay's, so
// its grids are fixed. The encoding writes one buffer from torch's allocator: the codes, then (uniform codes) each
// group's (lo, step) from ``aux_offset``. Parameters, as Triton's launcher passes them:
//   uniform quantize (x, codes, meta, n, seed, full); FewBit's bins (x, edges, codes, n, full);
//   either's decoding (codes, meta or table, out, n, full).
// ``n`` is int32 below 2**31 elements, int64 from there (``wide``), as Triton types an integer by its value; ``full``
// (fewer than 2**31 programs) int32; the seed int64.
struct Launches {
  Kernel encode, decode;
  // Where a compiled graph's stochastic save may be captured by CUDA graphs: the quantize that reads its seed on the
  // device (SEED_IN_MEMORY) and the kernel that advances that seed (``seed``, one int64 on the device) before it, both
  // launched while the stream is capturing, so that every replay draws new noise.
  Kernel encode_from_memory, advance;
  at::Tensor seed;
  int64_t n = 0, encode_grid = 0, encode_full = 0, decode_grid = 0, decode_full = 0;
  bool wide = false, seeded = true;  // seeded: uniform codes; else FewBit's bins
  int64_t code_bytes = 0, aux_offset = 0, buffer_bytes = 0;
  at::Tensor edges, table;  // FewBit's bins: on the device
  at::ScalarType dtype = at::kFloat;
  c10::Device device{c10::kCPU};
};

// The encoding's launch of ``x`` (contiguous, ``n`` elements, 16-byte aligned) into ``buffer`` (``buffer_bytes``),
// and the decoding's of ``buffer`` into ``out`` (contiguous, new): on torch's current stream of ``l.device``.
void launch_encode(const Launches& l, const at::Tensor& x, void* buffer, int64_t seed);
void launch_decode(const Launches& l, const void* buffer, at::Tensor& out);

// What a save stored and how to read it back: the saved tensor's version counter as autograd checks it, and the saved
// tensor itself while something else keeps it alive and unchanged (then backward reads its exact values).
struct Saved {
  at::Tensor data;  // the codes
  at::Tensor meta;  // each group's (lo, step) (uniform codes), or the table the codes index (bins)
  int64_t bits = 0, group = 0;  // group 0: bins
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;
  WeakImpl saved{StrongImpl()}, owner{StrongImpl()};  // the saved tensor, and what keeps its storage (its base for a view, else itself)
  int64_t version = 0;        // the saved tensor's version at the save
  int64_t owner_version = 0;  // its owner's, at the save
  bool through_base = false;
  const void* storage = nullptr;  // the owner's storage at the save
  std::shared_ptr<const Launches> launches;  // decoded by a launch (data: the buffer Launches describes)

  Saved();
  ~Saved();
  Saved(const Saved&) = delete;
  Saved& operator=(const Saved&) = delete;

  // The saved tensor's values: itself where it is alive and unchanged, else decoded. A change in place since the save
  // is returned as the tensor that changed and the version it had (``changed`` defined); nothing is decoded then.
  at::Tensor unpack(at::Tensor& changed, int64_t& expected) const;
  int64_t nbytes() const;  // what the handle holds: codes and metadata (a bins table too)

  static std::atomic<int64_t> alive;  // handles not yet freed (the leak tests count them)
};

// The encoder of one replayed save, its arguments bound: ``pack(t, seed)`` stores ``t`` and returns its handle, or
// nullptr where ``t`` is not contiguous (the caller's path then stores it in memory order).
struct Packer {
  int64_t bits = 0, group = 0;  // group 0: bins
  bool stochastic = true;
  double factor = 0.0, factor_special = 0.0;
  at::Tensor edges, table;  // bins
  std::shared_ptr<const Launches> launches;  // encoded and decoded by launches of Triton's kernels

  static Packer quantized(int64_t bits, int64_t group, bool stochastic, double factor, double factor_special);
  static Packer bins(at::Tensor edges, int64_t bits, at::Tensor table);
  static Packer launched(int64_t bits, int64_t group, Launches launches);
  // Whether ``pack`` stores ``t`` (else the caller's path does): contiguous, on the packer's device, and for launches
  // of its size and dtype, its data 16-byte aligned (as the kernels were compiled).
  bool accepts(const at::Tensor& t) const;
  std::unique_ptr<Saved> pack(const at::Tensor& t, int64_t seed) const;
};

}  // namespace gactx
