// Ops for compiled graphs (gactx_cpu::*_saved): a graph's own code calls them with no Python of gactx's, through the
// dispatcher, or as module.cpp's bindings (Inductor's Python wrapper, for those of a tensor and a token: cpu.DIRECT).
// A compressed save's ops take its token alone (with its shape where that is dynamic): what it stores by is registered
// under the token while its graph is traced (register_saved, from compiled.py), and each argument a call passes costs
// Inductor's Python wrapper its parsing: 64 x 64 at 4 bits on a 2-core Xeon, quantize took 5.6 us a call with six
// arguments and dequantize 3.5 with five (the shape a list), 4.1 and 2.2 with the token (and 512-bit vectors, cpu.py).
// Each logs that a save ran (its token and shape) and returns one tensor, what it stores, from a buffer of torch's CPU
// allocator (what torch's memory accounting sees) whose release logs that too (its backward ran, or the graph was
// dropped); a save kept as it is returns a one-byte marker alike. A save of a static shape after its graph's first
// one passes a negative token and logs nothing: the first one's entry records the graph's saves (compiled.py). The controller reads the log when it next looks at
// its passes (compiled.py). One output a save: each output costs the graph's code a Python tensor, a size check and
// a saved tensor of AOTAutograd's. Seeds of stochastic rounding come from a counter here: a new one at every call,
// mixed with the caller's salt.

#include "common.h"
#include "kernels.h"
#include "saved.h"

#include <ATen/ops/empty.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <unordered_map>

namespace gactx {

namespace {

std::mutex log_mutex;
std::vector<int64_t> save_log;  // entries: kind (0 saved, 2 released), token, rank, sizes...
std::atomic<uint64_t> draws{0};
constexpr size_t kLogLimit = size_t(1) << 22;  // int64s (32 MiB): a log nobody reads is dropped, not grown

// What a compressed save of a compiled graph stores by, registered under its token while the graph is traced.
struct SaveSpec {
  int64_t bits = 0, group = 0, salt = 0, dtype = 0;  // dtype: an index of kFloatDtypes
  bool stochastic = true, logged = true;  // logged: its own log entry (a graph's first save), else its lead's
  double factor = 0.0, factor_special = 0.0;
  std::vector<int64_t> sizes;  // the saved shape where it is static
};
std::mutex spec_mutex;
std::unordered_map<int64_t, std::shared_ptr<const SaveSpec>> specs;  // registered again: replaced, never changed
// A save whose codes Triton's kernels write, launched from C++ (a CUDA tensor; a CPU one under native.recording):
// its launches for the registered size, by token (register_launches).
std::unordered_map<int64_t, std::shared_ptr<const Launches>> launched;

std::shared_ptr<const Launches> launches_of(int64_t token) {
  std::lock_guard<std::mutex> lock(spec_mutex);
  auto found = launched.find(token);
  return found == launched.end() ? nullptr : found->second;
}

std::shared_ptr<const SaveSpec> spec_of(int64_t token) {
  std::lock_guard<std::mutex> lock(spec_mutex);
  auto found = specs.find(token);
  TORCH_CHECK(found != specs.end(), "gactx: no compressed save is registered under token ", token,
              " (registrations are made while a graph is traced: was it traced in another process?)");
  return found->second;
}

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

// ``nbytes`` bytes (at least one) on ``t``'s device for the save of ``t`` under ``token``, from the device's allocator
// (torch's caching allocator on a GPU): the save is logged now, its release when the buffer is freed. A negative token:
// a save recorded with its graph's first (compiled.py's followers), not logged.
at::Tensor logged_buffer(const at::Tensor& t, int64_t token, int64_t nbytes) {
  nbytes = std::max<int64_t>(nbytes, 1);
  const c10::Device device = t.device();
  if (token < 0) return device.is_cpu() ? cpu_empty({nbytes}, at::kByte) : at::empty({nbytes}, t.options().dtype(at::kByte));
  const c10::DeviceGuard guard(device);
  c10::Allocator* allocator = device.is_cpu() ? c10::GetCPUAllocator() : c10::GetAllocator(device.type());
  c10::DataPtr inner = allocator->allocate(nbytes);
  void* data = inner.get();
  const c10::Device at = inner.device();
  auto* logged = new Logged{std::move(inner), token};
  c10::DataPtr outer(data, logged, &release_logged, at);
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, std::move(outer), nullptr, false);
  const auto key = c10::computeDispatchKey(at::kByte, at::kStrided, at);
  at::Tensor out = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(key),
                                                            caffe2::TypeMeta::Make<uint8_t>());
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

void register_saved(int64_t token, int64_t bits, int64_t group, bool stochastic, int64_t salt, bool logged,
                    int64_t dtype, std::vector<int64_t> sizes) {
  TORCH_CHECK(bits >= 1 && bits <= 8 && group >= 1 && dtype >= 0 && dtype < 3);
  const int64_t levels = (int64_t(1) << bits) - 1;
  auto spec = std::make_shared<const SaveSpec>(SaveSpec{bits, group, salt, dtype, stochastic, logged,
                                                       step_factor(levels), step_factor(levels - 1), std::move(sizes)});
  std::lock_guard<std::mutex> lock(spec_mutex);
  specs[token] = std::move(spec);
}

void register_launches(int64_t token, const Packer& packer) {
  TORCH_CHECK(packer.launches, "gactx: register_launches takes a packer of native launches");
  std::lock_guard<std::mutex> lock(spec_mutex);
  launched[token] = packer.launches;
}

// Codes then the groups' (lo, step) in one buffer: ``code_bytes`` bytes, a multiple of 4, then 8 bytes a group; where
// the token's save is launched, the groups' from the launches' 16-byte aligned offset.
at::Tensor quantize_saved(const at::Tensor& t, int64_t token) {
  const auto found = spec_of(token);
  const SaveSpec& spec = *found;
  if (const auto l = launches_of(token)) {
    at::Tensor x = t.is_contiguous() ? t : t.contiguous();
    if (reinterpret_cast<uintptr_t>(x.const_data_ptr()) % 16 != 0) x = x.clone();  // as the kernels were compiled
    TORCH_CHECK(x.numel() == l->n && x.scalar_type() == l->dtype, "gactx: a compiled graph's save of ", x.numel(),
                " elements, registered for ", l->n);
    at::Tensor out = logged_buffer(t, spec.logged ? token : -1, l->buffer_bytes);
    launch_encode(*l, x, out.data_ptr(), spec.stochastic ? next_seed(spec.salt) : 0);
    return out;
  }
  const at::Tensor x = t.is_contiguous() ? t : t.contiguous();  // the kernel reads the elements in order, any shape
  const int64_t n = x.numel(), groups = (n + spec.group - 1) / spec.group;
  const int64_t codes = code_bytes(n, spec.bits, spec.group);
  at::Tensor out = logged_buffer(t, spec.logged ? token : -1, codes + groups * 8);
  uint8_t* data = out.data_ptr<uint8_t>();
  const int64_t seed = (spec.stochastic && n) ? next_seed(spec.salt) : 0;
  quantize_into(x, data, reinterpret_cast<float*>(data + codes), spec.bits, spec.group, spec.stochastic, seed,
                spec.factor, spec.factor_special);
  return out;
}

at::Tensor dequantize_in(const at::Tensor& stored, int64_t token, const SaveSpec& spec, at::IntArrayRef shape) {
  TORCH_CHECK(stored.is_contiguous() && stored.scalar_type() == at::kByte);
  if (const auto l = launches_of(token)) {
    at::Tensor out = at::empty(shape, stored.options().dtype(l->dtype));
    launch_decode(*l, stored.const_data_ptr(), out);
    return out;
  }
  at::Tensor out = cpu_empty(shape, kFloatDtypes[spec.dtype]);
  const uint8_t* data = stored.data_ptr<uint8_t>();
  const int64_t codes = code_bytes(out.numel(), spec.bits, spec.group);
  dequantize_into(data, reinterpret_cast<const float*>(data + codes), out, spec.bits, spec.group);
  return out;
}

// Decoded in the saved tensor's shape, the registered one: a graph's code then needs no view of the result (a call
// of its own).
at::Tensor dequantize_saved(const at::Tensor& stored, int64_t token) {
  const auto spec = spec_of(token);
  return dequantize_in(stored, token, *spec, spec->sizes);
}

// The same for a save of a dynamic shape, given as the graph runs it. (SymInt[]: what a graph with dynamic shapes
// passes; Inductor's C++ wrapper boxes it as a list of SymInts.)
at::Tensor dequantize_shaped(const at::Tensor& stored, int64_t token, c10::SymIntArrayRef shape) {
  return dequantize_in(stored, token, *spec_of(token), C10_AS_INTARRAYREF_SLOW(shape));
}

at::Tensor pack_bool_saved(const at::Tensor& t, int64_t token) {
  const at::Tensor mask = t.is_contiguous() ? t : t.contiguous();
  at::Tensor packed = logged_buffer(t, token, (mask.numel() + 7) / 8);
  pack_bool(mask, packed);
  return packed;
}

at::Tensor unpack_bool_saved(const at::Tensor& packed, c10::SymIntArrayRef shape) {
  at::Tensor mask = cpu_empty(C10_AS_INTARRAYREF_SLOW(shape), at::kBool);
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
  // Under CUDA graphs a GPU's quantize draws its seed on the device (Launches' advance), so that each replay draws new
  // noise.
  m.def("quantize_saved(Tensor t, int token) -> Tensor", flexible);
  m.def("dequantize_saved(Tensor stored, int token) -> Tensor");
  m.def("dequantize_shaped(Tensor stored, int token, SymInt[] shape) -> Tensor");
  m.def("pack_bool_saved(Tensor t, int token) -> Tensor", flexible);
  m.def("unpack_bool_saved(Tensor packed, SymInt[] shape) -> Tensor");
  m.def("keep_saved(Tensor t, int token) -> Tensor", flexible);
}

TORCH_LIBRARY_IMPL(gactx_cpu, CPU, m) {
  m.impl("quantize_saved", &gactx::quantize_saved);
  m.impl("dequantize_saved", &gactx::dequantize_saved);
  m.impl("dequantize_shaped", &gactx::dequantize_shaped);
  m.impl("pack_bool_saved", &gactx::pack_bool_saved);
  m.impl("unpack_bool_saved", &gactx::unpack_bool_saved);
  m.impl("keep_saved", &gactx::keep_saved);
}

// On a GPU: the saves registered with launches (register_launches), and the kept saves' markers.
TORCH_LIBRARY_IMPL(gactx_cpu, CUDA, m) {
  m.impl("quantize_saved", &gactx::quantize_saved);
  m.impl("dequantize_saved", &gactx::dequantize_saved);
  m.impl("dequantize_shaped", &gactx::dequantize_shaped);
  m.impl("keep_saved", &gactx::keep_saved);
}

// No autograd kernels: graphs call the ops where nothing is recorded (AOTAutograd's compiled forward and backward),
// and autograd's fallback for an op without one, which checks every input, cost as much as the op at small sizes.
TORCH_LIBRARY_IMPL(gactx_cpu, Autograd, m) {
  for (const char* name : {"quantize_saved", "dequantize_saved", "dequantize_shaped", "pack_bool_saved",
                           "unpack_bool_saved", "keep_saved"})
    m.impl(name, torch::CppFunction::makeFallthrough());
}
