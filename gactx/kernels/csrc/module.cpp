// The Python module of gactx's CPU kernels (cpu.py calls these); the ops of compiled graphs register themselves with
// the dispatcher (graph_ops.cpp), and those Inductor's Python wrapper calls directly are bound here too (cpu.DIRECT).
#include <torch/python.h>

#include "kernels.h"
#include "saved.h"

namespace gactx {
// The pack hook's lane (lane.cpp), the unpack hook's eager work and a hook's own call (hooks.cpp), as functions of
// Python's own.
pybind11::object make_lane(pybind11::object path, pybind11::object tracker, pybind11::object kept,
                           pybind11::object saving, pybind11::object view_names, pybind11::object passing,
                           int precall, int precall_to_call);
pybind11::object make_unpack(pybind11::object kept);
int64_t lane_timing(bool on);  // timing of the lanes' packers on or off; the nanoseconds timed since the last call
pybind11::object make_dispatch(pybind11::object hook, pybind11::object local, pybind11::object frame_callback);
// Launches through the CUDA driver (driver.cpp).
bool driver_built();
std::string open_driver(const std::string& library);
int64_t load_function(const pybind11::bytes& cubin, const std::string& name, int64_t shared);
void launch(int64_t function, int64_t grid_x, int64_t grid_y, int64_t grid_z, int64_t threads, int64_t shared,
            int64_t stream, const std::string& kinds, const pybind11::sequence& values);
}  // namespace gactx

namespace {

// What makes the error of a saved tensor changed in place (store.modified_in_place, set by the pack path): raised from
// Saved.unpack. Never freed: a handle may be unpacked while the interpreter exits.
pybind11::object* modified_error = nullptr;

at::Tensor unpack_saved(const gactx::Saved& handle) {
  at::Tensor changed;
  int64_t expected = 0;
  at::Tensor out = handle.unpack(changed, expected);
  if (changed.defined()) {
    TORCH_CHECK(modified_error != nullptr, "a saved tensor was modified in place after it was saved");
    pybind11::object error = (*modified_error)(changed, expected);
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
    throw pybind11::error_already_set();
  }
  return out;
}

gactx::Kernel kernel_of(const std::tuple<int64_t, int64_t, int64_t, int64_t>& k) {
  gactx::Kernel out;
  std::tie(out.function, out.threads, out.shared, out.scratch) = k;
  return out;
}

// Packer.launched (native.py): the saves' dtype, device and size; each kernel a (function, threads, shared,
// scratch) tuple; grids as (programs, full).
gactx::Packer launched_packer(int64_t bits, int64_t group, at::ScalarType dtype, at::Device device, int64_t n,
                              const std::tuple<int64_t, int64_t, int64_t, int64_t>& encode,
                              const std::tuple<int64_t, int64_t, int64_t, int64_t>& decode,
                              const std::tuple<int64_t, int64_t>& encode_grid,
                              const std::tuple<int64_t, int64_t>& decode_grid, int64_t code_bytes, int64_t aux_offset,
                              int64_t buffer_bytes, std::optional<at::Tensor> edges, std::optional<at::Tensor> table) {
  gactx::Launches l;
  l.encode = kernel_of(encode);
  l.decode = kernel_of(decode);
  l.n = n;
  std::tie(l.encode_grid, l.encode_full) = encode_grid;
  std::tie(l.decode_grid, l.decode_full) = decode_grid;
  l.wide = l.n >= (int64_t(1) << 31);
  l.seeded = !edges.has_value();
  l.code_bytes = code_bytes, l.aux_offset = aux_offset, l.buffer_bytes = buffer_bytes;
  if (edges) l.edges = edges->contiguous();
  if (table) l.table = table->contiguous();
  l.dtype = dtype;
  l.device = device;
  return gactx::Packer::launched(bits, group, std::move(l));
}

// Packer.with_device_seed (native.py): ``packer``'s launches, and for a capture by CUDA graphs the quantize that reads
// its seed from ``seed`` (one int64 on the device) and the kernel that advances it.
gactx::Packer with_device_seed(const gactx::Packer& packer, const std::tuple<int64_t, int64_t, int64_t, int64_t>& from_memory,
                               const std::tuple<int64_t, int64_t, int64_t, int64_t>& advance, const at::Tensor& seed) {
  TORCH_CHECK(packer.launches && packer.launches->seeded && seed.numel() == 1 && seed.scalar_type() == at::kLong &&
              seed.device() == packer.launches->device);
  gactx::Launches l = *packer.launches;
  l.encode_from_memory = kernel_of(from_memory);
  l.advance = kernel_of(advance);
  l.seed = seed;
  return gactx::Packer::launched(packer.bits, packer.group, std::move(l));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize", &gactx::quantize);
  m.def("dequantize", &gactx::dequantize);
  m.def("normal_quantize", &gactx::normal_quantize);
  m.def("normal_dequantize", &gactx::normal_dequantize);
  m.def("uniform_variances", &gactx::uniform_variances);
  m.def("normal_variances", &gactx::normal_variances);
  m.def("row_variances", &gactx::row_variances);
  m.def("add_weighted_norms", &gactx::add_weighted_norms);
  m.def("inverse_variance", &gactx::inverse_variance);
  m.def("kept_rows", &gactx::kept_rows);
  m.def("encode_bins", &gactx::encode_bins);
  m.def("decode_table", &gactx::decode_table);
  m.def("pack_bool", &gactx::pack_bool);
  m.def("pack_compare", &gactx::pack_compare);
  m.def("unpack_bool", &gactx::unpack_bool);
  m.def("drain_log", &gactx::drain_log);
  m.def("register_saved", &gactx::register_saved);
  m.def("register_launches", &gactx::register_launches);
  // The compiled graphs' ops as Inductor's Python wrapper calls them (cpu.DIRECT): without the GIL while they run, as
  // through the dispatcher.
  const auto no_gil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("quantize_saved", &gactx::quantize_saved, no_gil);
  m.def("dequantize_saved", &gactx::dequantize_saved, no_gil);
  m.def("pack_bool_saved", &gactx::pack_bool_saved, no_gil);
  m.def("keep_saved", &gactx::keep_saved, no_gil);

  namespace py = pybind11;
  py::class_<gactx::Saved>(m, "Saved")
      .def("unpack", &unpack_saved)
      .def_property_readonly("nbytes", &gactx::Saved::nbytes)
      .def_readonly("data", &gactx::Saved::data)
      .def_readonly("meta", &gactx::Saved::meta)
      .def_readonly("bits", &gactx::Saved::bits)
      .def_static("alive", [] { return gactx::Saved::alive.load(); });
  py::class_<gactx::Packer>(m, "Packer")
      .def_static("quantized", &gactx::Packer::quantized)
      .def_static("bins", &gactx::Packer::bins)
      .def_static("launched", &launched_packer)
      .def_static("with_device_seed", &with_device_seed)
      .def("accepts", &gactx::Packer::accepts)
      .def_property_readonly("launching", [](const gactx::Packer& p) { return static_cast<bool>(p.launches); })
      .def_property_readonly("buffer_bytes",
                             [](const gactx::Packer& p) { return p.launches ? p.launches->buffer_bytes : int64_t(0); })
      .def("__call__", &gactx::Packer::pack);
  m.def("current_stream", [](at::Device device) { return reinterpret_cast<int64_t>(gactx::current_stream(device)); });
  m.def("driver_built", &gactx::driver_built);
  m.def("open_driver", &gactx::open_driver);
  m.def("load_function", &gactx::load_function);
  m.def("launch", &gactx::launch);
  m.def("lane", &gactx::make_lane);
  m.def("unpack_hook", &gactx::make_unpack);
  m.def("lane_timing", &gactx::lane_timing);
  m.def("hook_call", &gactx::make_dispatch);
  m.def("set_modified_error", [](py::object make) {
    if (modified_error == nullptr) modified_error = new py::object();
    *modified_error = std::move(make);
  });
}
