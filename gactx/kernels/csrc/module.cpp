// The Python module of gactx's CPU kernels (cpu.py calls these); the ops of compiled graphs register themselves with
// the dispatcher (graph_ops.cpp).
#include <torch/python.h>

#include "kernels.h"

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
}
