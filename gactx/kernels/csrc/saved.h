// A replayed save's handle, made and read in one call each way (saved.cpp; gactx/controller/replay.py): what the pack
// hook returns for a CPU tensor that the uniform scheme's codes or FewBit's bins store, and decodes on unpack. It does
// what the pack path's Python handle (store.Packed) does for such a save, without a Python object a field.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

namespace gactx {

using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
using StrongImpl = c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

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

  static Packer quantized(int64_t bits, int64_t group, bool stochastic, double factor, double factor_special);
  static Packer bins(at::Tensor edges, int64_t bits, at::Tensor table);
  std::unique_ptr<Saved> pack(const at::Tensor& t, int64_t seed) const;
};

}  // namespace gactx
