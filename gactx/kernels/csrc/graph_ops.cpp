// Ops for compiled graphs (gactx_cpu::*_saved): a graph's own code calls them through the dispatcher, with no Python.
// Each logs that a save ran (its token and shape) and returns one tensor, what it stores, from a buffer of torch's CPU
// allocator (what torch's memory accounting sees) whose release logs that too (its backward ran, or the graph was
// dropped); a save kept as it is returns a one-byte marker alike. A save of a static shape after its graph's first
// one passes a negative token and logs nothing: the first one's entry records the graph's saves (compiled.py). The controller reads the log when it next looks at
// its passes (compiled.py). One output a save: each output costs the graph's code a Python tensor, a size check and
// a saved tensor of AOTAutograd's. Seeds of stochastic rounding come from a counter here: a new one at every call,
// mixed with the caller's salt.

#include "common.h"
#include "kernels.h"

#include <c10/core/CPUAllocator.h>
#include <torch/library.h>

#include <atomic>
#include <mutex>

namespace gactx {

namespace {

std::mutex log_mutex;
std::vector<int64_t> save_log;  // entries: kind (0 saved, 2 released), token, rank, sizes...
std::atomic<uint64_t> draws{0};
constexpr size_t kLogLimit = size_t(1) << 22;  // int64s (32 MiB): a log nobody reads is dropped, not grown

void log_event(int64_t kind, int64_t token, at::IntArrayRef sizes) {
  std::lock_guard<std::mutex> lock(log_mutex);
  if (save_log.size() > kLogLimit) save_log.clear();
  save_log.push_back(kind);
  save_log.push_back(token);
  save_log.push_back(int64_t(sizes.size()));
  for (int64_t s : sizes) save_log.push_back(s);
}

struct Logged {  // an allocation of the CPU allocator, and the save whose release its freeing logs
  c10::DataPtr inner;
  int64_t token;
};

void release_logged(void* context) {
  auto* logged = static_cast<Logged*>(context);
  const int64_t token = logged->token;
  delete logged;  // frees the buffer through its allocator
  log_event(2, token, {});
}

// ``nbytes`` bytes (at least one) for the save of ``t`` under ``token``: the save is logged now, its release when the
// buffer is freed. A negative token: a save recorded with its graph's first (compiled.py's followers), not logged.
at::Tensor logged_buffer(const at::Tensor& t, int64_t token, int64_t nbytes) {
  nbytes = std::max<int64_t>(nbytes, 1);
  if (token < 0) return at::empty({nbytes}, at::TensorOptions().dtype(at::kByte));
  c10::DataPtr inner = c10::GetCPUAllocator()->allocate(nbytes);
  void* data = inner.get();
  auto* logged = new Logged{std::move(inner), token};
  c10::DataPtr outer(data, logged, &release_logged, c10::Device(c10::kCPU));
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, std::move(outer), nullptr, false);
  at::Tensor out = at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU), caffe2::TypeMeta::Make<uint8_t>());
  out.unsafeGetTensorImpl()->set_sizes_contiguous({nbytes});
  log_event(0, token, t.sizes());
  return out;
}

int64_t next_seed(int64_t salt) {  // as schemes/uniform/traced.py's draws: ((draw * golden) ^ (salt * c)) mod 2**62
  const uint64_t draw = draws.fetch_add(1) + 1;
  const uint64_t mixed = (draw * 0x9E3779B97F4A7C15ull) ^ (uint64_t(salt) * 0xC2B2AE3D27D4EB4Full);
  return int64_t(mixed & ((uint64_t(1) << 62) - 1));
}

int64_t code_bytes(int64_t n, int64_t bits, int64_t group) { return (n + group - 1) / group * group * bits / 8; }

// format.py's step_factor: (1 + 2**-20) / intervals in double, rounded to float32 (0 for no interval).
double step_factor(int64_t intervals) {
  return intervals ? double(float((1.0 + std::ldexp(1.0, -20)) / double(intervals))) : 0.0;
}

// format.py's FLOAT_DTYPES, in order: what dequantize_saved's ``dtype`` indexes (an int is parsed faster than a dtype).
constexpr at::ScalarType kFloatDtypes[] = {at::kFloat, at::kHalf, at::kBFloat16};

}  // namespace

// Codes then the groups' (lo, step) in one buffer: ``code_bytes`` bytes, a multiple of 4, then 8 bytes a group. The
// step factors follow from ``bits`` (cpu.py's step_factors): each argument costs a graph's Python wrapper its parsing.
at::Tensor quantize_saved(const at::Tensor& t, int64_t bits, int64_t group, bool stochastic, int64_t salt,
                          int64_t token) {
  const int64_t levels = (int64_t(1) << bits) - 1;
  const double factor = step_factor(levels), factor_special = step_factor(levels - 1);
  const at::Tensor x = t.is_contiguous() ? t : t.contiguous();  // the kernel reads the elements in order, any shape
  const int64_t n = x.numel(), groups = (n + group - 1) / group, codes = code_bytes(n, bits, group);
  at::Tensor out = logged_buffer(t, token, codes + groups * 8);
  uint8_t* data = out.data_ptr<uint8_t>();
  const int64_t seed = (stochastic && n) ? next_seed(salt) : 0;
  quantize_into(x, data, reinterpret_cast<float*>(data + codes), bits, group, stochastic, seed, factor, factor_special);
  return out;
}

// Decoded in the saved tensor's shape: a graph's code then needs no view of the result (a call of its own).
// (SymInt[]: what a graph with dynamic shapes passes; Inductor's C++ wrapper boxes it as a list of SymInts.)
at::Tensor dequantize_saved(const at::Tensor& stored, int64_t bits, int64_t group, c10::SymIntArrayRef shape,
                            int64_t dtype) {
  TORCH_CHECK(stored.is_contiguous() && stored.scalar_type() == at::kByte && dtype >= 0 && dtype < 3);
  at::Tensor out = at::empty(C10_AS_INTARRAYREF_SLOW(shape), at::TensorOptions().dtype(kFloatDtypes[dtype]));
  const uint8_t* data = stored.data_ptr<uint8_t>();
  dequantize_into(data, reinterpret_cast<const float*>(data + code_bytes(out.numel(), bits, group)), out, bits, group);
  return out;
}

at::Tensor pack_bool_saved(const at::Tensor& t, int64_t token) {
  const at::Tensor mask = t.is_contiguous() ? t : t.contiguous();
  at::Tensor packed = logged_buffer(t, token, (mask.numel() + 7) / 8);
  pack_bool(mask, packed);
  return packed;
}

at::Tensor unpack_bool_saved(const at::Tensor& packed, c10::SymIntArrayRef shape) {
  at::Tensor mask = at::empty(C10_AS_INTARRAYREF_SLOW(shape), at::TensorOptions().dtype(at::kBool));
  unpack_bool(packed, mask);
  return mask;
}

// A save kept as it is: logged, and its marker (an op's result must be a new tensor).
at::Tensor keep_saved(const at::Tensor& t, int64_t token) { return logged_buffer(t, token, 1); }

std::vector<int64_t> drain_log() {
  std::lock_guard<std::mutex> lock(log_mutex);
  std::vector<int64_t> out;
  out.swap(save_log);
  return out;
}

}  // namespace gactx

TORCH_LIBRARY(gactx_cpu, m) {
  const std::vector<at::Tag> flexible = {at::Tag::flexible_layout};  // a saved value in any layout: no copy first
  m.def("quantize_saved(Tensor t, int bits, int group, bool stochastic, int salt, int token) -> Tensor", flexible);
  m.def("dequantize_saved(Tensor stored, int bits, int group, SymInt[] shape, int dtype) -> Tensor");
  m.def("pack_bool_saved(Tensor t, int token) -> Tensor", flexible);
  m.def("unpack_bool_saved(Tensor packed, SymInt[] shape) -> Tensor");
  m.def("keep_saved(Tensor t, int token) -> Tensor", flexible);
}

TORCH_LIBRARY_IMPL(gactx_cpu, CPU, m) {
  m.impl("quantize_saved", &gactx::quantize_saved);
  m.impl("dequantize_saved", &gactx::dequantize_saved);
  m.impl("pack_bool_saved", &gactx::pack_bool_saved);
  m.impl("unpack_bool_saved", &gactx::unpack_bool_saved);
  m.impl("keep_saved", &gactx::keep_saved);
}

// No autograd kernels: graphs call the ops where nothing is recorded (AOTAutograd's compiled forward and backward),
// and autograd's fallback for an op without one, which checks every input, cost as much as the op at small sizes.
TORCH_LIBRARY_IMPL(gactx_cpu, Autograd, m) {
  for (const char* name : {"quantize_saved", "dequantize_saved", "pack_bool_saved", "unpack_bool_saved", "keep_saved"})
    m.impl(name, torch::CppFunction::makeFallthrough());
}
