// The kernels each source file defines, as module.cpp binds them for Python and graph_ops.cpp calls them.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>
#include <vector>

namespace gactx {

// schemes/uniform/uniform.cpp: per-group codes with stochastic or nearest rounding (schemes/uniform/format.py).
std::tuple<at::Tensor, at::Tensor> quantize(at::Tensor x, int64_t bits, int64_t group, bool stochastic, int64_t seed,
                                            double factor, double factor_special);
// The decoded tensor, contiguous of ``shape`` in ``dtype``.
at::Tensor dequantize(at::Tensor codes, at::Tensor meta, at::IntArrayRef shape, at::ScalarType dtype, int64_t bits,
                      int64_t group);
// The same, into buffers the caller allocated: ``codes`` of code_bytes(n), ``meta`` of 2 floats a group.
void quantize_into(const at::Tensor& x, uint8_t* codes, float* meta, int64_t bits, int64_t group, bool stochastic,
                   int64_t seed, double factor, double factor_special);
void dequantize_into(const uint8_t* codes, const float* meta, at::Tensor& out, int64_t bits, int64_t group);
// The expected squared error of stochastic rounding at each width (variance.py's uniform_variances), summed in float64
// over every group (stride 1) or over groups 0, stride, 2 stride, ... of the whole ones (variance.group_sample), times
// scale, as float32.
at::Tensor uniform_variances(at::Tensor x, int64_t group, std::vector<int64_t> widths, std::vector<double> factors,
                             std::vector<double> special_factors, int64_t stride, double scale);

// schemes/normal/normal.cpp: normal-fitted levels (schemes/normal/format.py).
std::tuple<at::Tensor, at::Tensor> normal_quantize(at::Tensor x, int64_t bits, int64_t group, bool stochastic,
                                                   int64_t seed, std::vector<double> factors, int64_t tails);
void normal_dequantize(at::Tensor codes, at::Tensor meta, at::Tensor out, int64_t bits, int64_t group,
                       std::vector<double> factors, int64_t tails);
// The same as uniform_variances, on the normal scheme's levels (variance.py's normal_variances).
at::Tensor normal_variances(at::Tensor x, int64_t group, std::vector<int64_t> widths,
                            std::vector<std::vector<double>> factors, std::vector<int64_t> tails, int64_t stride,
                            double scale);

// free.cpp: the free estimator's reductions (variance.py's row_variances and add_weighted_norms).
// Per row of x's ``rows`` equal rows (flattened), the sum of its elements' group terms (hi - lo)^2 / 6, float32.
at::Tensor row_variances(at::Tensor x, int64_t group, int64_t rows);
// total[0] += sum_r weights[r] * ||g_r||^2 over g's weights.numel() equal rows (summed in float64).
void add_weighted_norms(at::Tensor total, at::Tensor g, at::Tensor weights);
// The mean over channels of 1 / (var + eps), each channel's variance over x's outer and inner dimensions (x as
// [outer, channels, inner]), as one float32 element.
at::Tensor inverse_variance(at::Tensor x, int64_t outer, int64_t channels, int64_t inner, double eps);

// sketch.cpp: the row sketch's rows (schemes/sketch.py's kept_rows): the n_kept rows of n_rows that seed chooses, or
// (complement) the others, int64 in increasing order.
at::Tensor kept_rows(int64_t n_rows, int64_t n_kept, int64_t seed, bool complement);

// codes.cpp: table codes, FewBit's bins (codes.py, fewbit.py).
// The packed codes (``8 / bits`` a byte) of each element's bin among the sorted ``edges``; ``table`` looked up by
// codes, contiguous of ``shape`` in the table's dtype.
at::Tensor encode_bins(at::Tensor x, at::Tensor edges, int64_t bits);
at::Tensor decode_table(at::Tensor packed, at::Tensor table, at::IntArrayRef shape, int64_t bits);

// bitmask.cpp: masks 8 to a byte (bitmask.py).
void pack_bool(at::Tensor mask, at::Tensor packed);
at::Tensor pack_compare(at::Tensor x, int64_t kind, double lo, double hi);
void unpack_bool(at::Tensor packed, at::Tensor mask);

// graph_ops.cpp: the log of compiled graphs' saves (compiled.py), and what a compressed save of one stores by, under
// its token (its ops take the token alone): width, group size, rounding, the noise's salt, whether it logs, the
// dtype's index in FLOAT_DTYPES and its shape where static (else empty).
std::vector<int64_t> drain_log();
void register_saved(int64_t token, int64_t bits, int64_t group, bool stochastic, int64_t salt, bool logged,
                    int64_t dtype, std::vector<int64_t> sizes);
// The save under ``token`` stored by native launches (a Packer's, ``native.quantize_packer``) instead of the C++ kernel.
struct Packer;
void register_launches(int64_t token, const Packer& packer);
// The ops of compiled graphs (graph_ops.cpp), bound to Python as well: the calls Inductor's Python wrapper makes of
// them (cpu.py's codegen), past the dispatcher.
at::Tensor quantize_saved(const at::Tensor& t, int64_t token);
at::Tensor dequantize_saved(const at::Tensor& stored, int64_t token);
at::Tensor pack_bool_saved(const at::Tensor& t, int64_t token);
at::Tensor keep_saved(const at::Tensor& t, int64_t token);

}  // namespace gactx
