// Launches of Triton's compiled kernels from C++, through the CUDA driver API: the cubin that Triton compiled is
// loaded once for each configuration, and each launch packs its parameters and calls cuLaunchKernel. The driver is
// reached through a table of its entry points, resolved from a library opened when the program runs (libcuda.so.1, as
// Triton and torch find it, or a recording driver in tests), so this builds on a machine with no GPU, against the
// cuda.h of the triton wheel. Without that header (GACTX_CUDA_H undefined) the functions say so and launch nothing.
#include <dlfcn.h>
#include <torch/python.h>

#include <c10/core/Stream.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef GACTX_CUDA_H
#include <cuda.h>
#endif

#include "launch.h"

namespace gactx {
namespace py = pybind11;

#ifdef GACTX_CUDA_H
namespace {

struct Driver {  // the entry points a launch needs, resolved from one library
  void* library = nullptr;
  decltype(&::cuModuleLoadData) module_load_data = nullptr;
  decltype(&::cuModuleGetFunction) module_get_function = nullptr;
  decltype(&::cuFuncSetAttribute) func_set_attribute = nullptr;
  CUresult (*launch_kernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                            CUstream, void**, void**) = nullptr;
  decltype(&::cuGetErrorString) get_error_string = nullptr;
  decltype(&::cuStreamIsCapturing) stream_is_capturing = nullptr;
};
Driver driver;

void check(CUresult result, const char* what) {
  if (result == CUDA_SUCCESS) return;
  const char* text = nullptr;
  if (driver.get_error_string != nullptr) driver.get_error_string(result, &text);
  throw std::runtime_error(std::string("gactx: ") + what + " failed: CUDA error " + std::to_string(result) +
                           (text != nullptr ? std::string(" (") + text + ")" : ""));
}

const Driver& opened() {
  if (driver.library == nullptr) throw std::runtime_error("gactx: no CUDA driver opened (native.open_driver)");
  return driver;
}

}  // namespace

bool driver_built() { return true; }

// c10::Stream::native_handle came with torch 2.10; under an older torch the current stream cannot be read from C++
// and native launches stay off (native._stream_problem says why).
template <typename S, typename = void>
struct has_native_handle : std::false_type {};
template <typename S>
struct has_native_handle<S, std::void_t<decltype(std::declval<const S&>().native_handle())>> : std::true_type {};

template <typename S>
void* native_handle(const S& stream) {
  if constexpr (has_native_handle<S>::value) {
    return stream.native_handle();
  } else {
    throw std::runtime_error("this torch's c10::Stream has no native_handle (torch 2.10 and later have it)");
  }
}

void* current_stream(const c10::Device& device) {
  if (device.is_cpu()) return nullptr;
  c10::impl::VirtualGuardImpl impl(device.type());
  return native_handle(impl.getStream(device));
}

bool stream_capturing(void* stream) {
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  check(opened().stream_is_capturing(reinterpret_cast<CUstream>(stream), &status), "cuStreamIsCapturing");
  return status != CU_STREAM_CAPTURE_STATUS_NONE;
}

void launch_kernel(const Kernel& kernel, int64_t grid, void* stream, void** params, int count) {
  const Driver& d = opened();
  void* all[16];
  TORCH_CHECK(count + kernel.scratch <= 16, "gactx: a launch of more than 16 parameters");
  static uint64_t null_pointer = 0;
  for (int i = 0; i < count; i++) all[i] = params[i];
  for (int64_t i = 0; i < kernel.scratch; i++) all[count + i] = &null_pointer;
  check(d.launch_kernel(reinterpret_cast<CUfunction>(kernel.function), static_cast<unsigned>(grid), 1, 1,
                        static_cast<unsigned>(kernel.threads), 1, 1, static_cast<unsigned>(kernel.shared),
                        reinterpret_cast<CUstream>(stream), all, nullptr),
        "cuLaunchKernel");
}

// Opens `library` and resolves the entry points; "" on success, else what is missing.
std::string open_driver(const std::string& library) {
  void* handle = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) return std::string("cannot open ") + library + ": " + dlerror();
  Driver found;
  found.library = handle;
  const char* missing = nullptr;
  auto resolve = [&](auto& slot, const char* name) {
    slot = reinterpret_cast<std::remove_reference_t<decltype(slot)>>(dlsym(handle, name));
    if (slot == nullptr && missing == nullptr) missing = name;
  };
  resolve(found.module_load_data, "cuModuleLoadData");
  resolve(found.module_get_function, "cuModuleGetFunction");
  resolve(found.func_set_attribute, "cuFuncSetAttribute");
  resolve(found.launch_kernel, "cuLaunchKernel");
  resolve(found.get_error_string, "cuGetErrorString");
  resolve(found.stream_is_capturing, "cuStreamIsCapturing");
  if (missing != nullptr) {
    dlclose(handle);
    return std::string(library) + " has no " + missing;
  }
  driver = found;
  return "";
}

// Loads `cubin` and returns its kernel `name`, allowed `shared` bytes of dynamic shared memory (over 48 KiB needs the
// attribute set, as Triton's loader sets it).
int64_t load_function(const py::bytes& cubin, const std::string& name, int64_t shared) {
  const Driver& d = opened();
  std::string image = cubin;
  CUmodule module = nullptr;
  CUfunction function = nullptr;
  check(d.module_load_data(&module, image.data()), "cuModuleLoadData");
  check(d.module_get_function(&function, module, name.c_str()), "cuModuleGetFunction");
  if (shared > 49152)
    check(d.func_set_attribute(function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, static_cast<int>(shared)),
          "cuFuncSetAttribute");
  return reinterpret_cast<int64_t>(function);
}

// Launches `function` on `stream` with one parameter a character of `kinds` ('p' a pointer, 'i' a 32-bit integer,
// 'q' a 64-bit one, 'f' a float32), from `values` in order.
void launch(int64_t function, int64_t grid_x, int64_t grid_y, int64_t grid_z, int64_t threads, int64_t shared,
            int64_t stream, const std::string& kinds, const py::sequence& values) {
  const Driver& d = opened();
  if (static_cast<size_t>(py::len(values)) != kinds.size())
    throw std::invalid_argument("gactx: launch: " + std::to_string(kinds.size()) + " kinds for " +
                                std::to_string(py::len(values)) + " values");
  std::vector<uint64_t> storage(kinds.size());  // one 8-byte slot a parameter; the driver reads each at its size
  std::vector<void*> params(kinds.size());
  for (size_t i = 0; i < kinds.size(); i++) {
    py::handle value = values[i];
    void* slot = &storage[i];
    switch (kinds[i]) {
      case 'p': *static_cast<uint64_t*>(slot) = value.cast<uint64_t>(); break;
      case 'q': *static_cast<int64_t*>(slot) = value.cast<int64_t>(); break;
      case 'i': *static_cast<int32_t*>(slot) = value.cast<int32_t>(); break;
      case 'f': *static_cast<float*>(slot) = value.cast<float>(); break;
      default: throw std::invalid_argument(std::string("gactx: launch: kind '") + kinds[i] + "' is not one of p q i f");
    }
    params[i] = slot;
  }
  check(d.launch_kernel(reinterpret_cast<CUfunction>(function), grid_x, grid_y, grid_z, threads, 1, 1, shared,
                        reinterpret_cast<CUstream>(stream), params.data(), nullptr),
        "cuLaunchKernel");
}

#else

bool driver_built() { return false; }
void* current_stream(const c10::Device&) { return nullptr; }
bool stream_capturing(void*) { return false; }
void launch_kernel(const Kernel&, int64_t, void*, void**, int) {
  throw std::runtime_error("gactx: the CPU kernels were built without cuda.h: no native launches");
}
std::string open_driver(const std::string&) { return "built without cuda.h (no triton wheel at build time)"; }
int64_t load_function(const py::bytes&, const std::string&, int64_t) {
  throw std::runtime_error("gactx: the CPU kernels were built without cuda.h: no native launches");
}
void launch(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, const std::string&, const py::sequence&) {
  throw std::runtime_error("gactx: the CPU kernels were built without cuda.h: no native launches");
}

#endif
}  // namespace gactx
