// The uniform scheme (arithmetic in format.py; layout in gactx/kernels/format.py): a group's range, then its codes at
// ``bits`` with stochastic or nearest rounding, one group at a time a thread.
#include "common.h"
#include "kernels.h"

namespace gactx {
namespace {

// A group's grid (format.py): its step, as the metadata stores it, and how an element is placed on it,
// (x * scale - origin) * inv + shift steps above the lowest level. A finite group whose span overflowed:
// step = fmax * f - fmin * f, elements at a quarter of their value (scale).
struct Grid {
  float step, scale, origin, inv, shift;
};

inline Grid group_grid(const GroupRange& r, int L, float factor, float factor_special) {
  const float fmin = r.fmin, fmax = r.fmax;
  const bool special = r.special();
  const float span = special ? 2.0f * std::max(-fmin, fmax) : fmax - fmin;
  const float scale = (special || span <= kFltMax) ? 1.0f : 0.25f;
  const float f = special ? factor_special : factor;
  float step = std::min(scale < 1.0f ? fmax * f - fmin * f : span * f, kFltMax);
  step = span > 0.0f ? std::max(step, kMinStep) : 0.0f;
  if (L == 1 && special) step = 0.0f;
  const float inv = step > 0.0f ? 1.0f / (step * scale) : 0.0f;
  return Grid{step, scale, (special ? 0.0f : fmin) * scale, inv, special ? float((L - 1) / 2) : 0.0f};
}

template <typename T>
void quantize_impl(const T* x, int64_t n, uint8_t* codes, float* meta, int bits, int64_t G, bool stochastic,
                   int64_t seed, float factor, float factor_special) {
  const int L = (1 << bits) - 1, per_byte = 8 / bits;
  const int64_t W = G / per_byte;  // bytes a group
  const int64_t groups = (n + G - 1) / G;
  const uint32_t k0 = uint32_t(uint64_t(seed)), k1 = uint32_t(uint64_t(seed) >> 32);
  const float top = float(L + 1);
  at::parallel_for(0, groups, grain(G * int64_t(sizeof(T))), [&](int64_t g0, int64_t g1) {
    alignas(64) float v[kMaxGroup];  // a group's values and codes: on the stack, no allocation a call
    alignas(64) uint8_t q[kMaxGroup];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t start = g * G, m = std::min(G, n - start);
      const T* xg = x + start;
      const GroupRange r = read_group(xg, m, v);
      const Grid grid = group_grid(r, L, factor, factor_special);
      const float step = grid.step, scale = grid.scale, inv = grid.inv, origin = grid.origin, shift = grid.shift;
      meta[2 * g] = r.special() ? r.kind() : r.fmin;
      meta[2 * g + 1] = step;
      if (stochastic) {
        const uint32_t high = k1 ^ uint32_t(uint64_t(start) >> 32) * 0x85EBCA77u, low = uint32_t(uint64_t(start));
        for (int64_t k = 0; k < m; ++k) {
          const float s = std::fabs((v[k] * scale - origin) * inv + (shift + one_plus_u(k0, high, low + uint32_t(k))));
          q[k] = uint8_t(int32_t(s < top ? s : top) - 1);  // NaN: the top code, as fmin(s, top)
        }
      } else {
        const float add = shift + 1.5f;
        for (int64_t k = 0; k < m; ++k) {
          const float s = std::fabs((v[k] * scale - origin) * inv + add);
          q[k] = uint8_t(int32_t(s < top ? s : top) - 1);
        }
      }
      for (int64_t k = m; k < G; ++k) q[k] = 0;
      uint8_t* out = codes + g * W;
      switch (bits) {
        case 1: pack_planes<1>(q, out, W); break;
        case 2: pack_planes<2>(q, out, W); break;
        case 4: pack_planes<4>(q, out, W); break;
        default: pack_planes<8>(q, out, W); break;
      }
    }
  });
}

template <typename T>
void dequantize_impl(const uint8_t* codes, const float* meta, T* out, int64_t n, int bits, int64_t G) {
  const int L = (1 << bits) - 1, centre = (L - 1) / 2, per_byte = 8 / bits;
  const int64_t W = G / per_byte;
  const int64_t groups = (n + G - 1) / G;
  const float hi = float(std::numeric_limits<T>::max());  // finite values saturate at the output's largest
  at::parallel_for(0, groups, grain(G * int64_t(sizeof(T))), [&](int64_t g0, int64_t g1) {
    T lut[256];  // a group's 2**bits values, each decoded once
    for (int64_t g = g0; g < g1; ++g) {
      const float lo = meta[2 * g];
      const bool special = !std::isfinite(lo);
      // Halves where q * step can overflow while the value does not (format.py).
      const bool wide = !special && lo < -1.0f && float(L) * meta[2 * g + 1] > kFltMax;
      const float half = wide ? 0.5f : 1.0f, twice = wide ? 2.0f : 1.0f;
      const float step = meta[2 * g + 1] * half, base = (special ? 0.0f : lo) * half;
      const int c = special ? centre : 0;
      const float top = special ? lo : std::min(std::max((float(L) * step + base) * twice, -hi), hi);
      const uint8_t* in = codes + g * W;
      const int64_t start = g * G, m = std::min(G, n - start);
      const bool computed = m == G && !special && std::is_same<T, float>::value;
      if (!computed) {
        for (int q = 0; q < L; ++q) {
          const float value = (float(q - c) * step + base) * twice;
          lut[q] = from_float<T>(std::min(std::max(value, -hi), hi));
        }
        lut[L] = from_float<T>(top);
      }
      if (computed) {
        // A finite group decodes every code, the top one too, to q * step + lo: computed, vectorized.
        for (int p = 0; p < per_byte; ++p) {
          float* o = reinterpret_cast<float*>(out) + start + p * W;
          const int shift = p * bits;
          for (int64_t k = 0; k < W; ++k) {
            const float value = (float((in[k] >> shift) & L) * step + base) * twice;
            o[k] = std::min(std::max(value, -hi), hi);
          }
        }
      } else if (m == G) {
        for (int p = 0; p < per_byte; ++p) {
          T* o = out + start + p * W;
          const int shift = p * bits;
          for (int64_t k = 0; k < W; ++k) o[k] = lut[(in[k] >> shift) & L];
        }
      } else {
        for (int64_t i = 0; i < m; ++i) out[start + i] = lut[(in[i % W] >> ((i / W) * bits)) & L];
      }
    }
  });
}

// The expected squared error of stochastic rounding at each of ``widths`` (variance.py's uniform_variances): a
// group's range and steps as quantize_impl finds them, then step^2 f (1 - f) an element a width, f the fraction of
// its position on the grid. Sums in float64, a group's into ``partial[g * widths + w]``.
template <typename T>
void uniform_variances_impl(const T* x, int64_t n, int64_t G, int64_t stride, const std::vector<int64_t>& widths,
                            const std::vector<double>& factors, const std::vector<double>& special_factors,
                            double* partial) {
  const int64_t groups = sampled_groups(n, G, stride), nw = int64_t(widths.size());
  at::parallel_for(0, groups, grain(G * int64_t(sizeof(T))), [&](int64_t g0, int64_t g1) {
    std::vector<float> v(G), fraction(G);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t start = g * stride * G, m = std::min(G, n - start);
      const GroupRange r = read_group(x + start, m, v.data());
      for (int64_t w = 0; w < nw; ++w) {
        const Grid grid = group_grid(r, (1 << widths[w]) - 1, float(factors[w]), float(special_factors[w]));
        const float scale = grid.scale, origin = grid.origin, inv = grid.inv, shift = grid.shift;
        // An element's fraction of a step, in float32: s - floor(s) is exact there (the fraction bits of s), so
        // f (1 - f) in float64 is too; 0 for a non-finite element. No branch: the loops vectorize.
        for (int64_t k = 0; k < m; ++k) {
          const float s = (v[k] * scale - origin) * inv + shift;
          fraction[k] = std::fabs(v[k]) <= kFltMax ? s - std::floor(s) : 0.0f;  // false for NaN
        }
        const float* f = fraction.data();
        const double sum = grid.step > 0.0f ? lane_sum(m, [f](int64_t k) {
          const double e = f[k];
          return e * (1.0 - e);
        }) : 0.0;
        partial[g * nw + w] = sum * double(grid.step) * double(grid.step);
      }
    }
  });
}

}  // namespace

// Outputs are allocated here: from Python each allocation costs more than a small tensor's kernel.
std::tuple<at::Tensor, at::Tensor> quantize(at::Tensor x, int64_t bits, int64_t group, bool stochastic, int64_t seed,
                                            double factor, double factor_special) {
  TORCH_CHECK(x.is_contiguous() && x.device().is_cpu());
  const int64_t n = x.numel(), groups = (n + group - 1) / group;
  at::Tensor codes = cpu_empty({groups * group * bits / 8}, at::kByte);
  at::Tensor meta = cpu_empty({groups, 2}, at::kFloat);
  quantize_into(x, codes.data_ptr<uint8_t>(), meta.data_ptr<float>(), bits, group, stochastic, seed, factor,
                factor_special);
  return {codes, meta};
}

void quantize_into(const at::Tensor& x, uint8_t* codes, float* meta, int64_t bits, int64_t group, bool stochastic,
                   int64_t seed, double factor, double factor_special) {
  const int64_t n = x.numel();
  TORCH_CHECK(group >= 1 && group <= kMaxGroup, "gactx quantize: group size ", group, " is not in 1..", kMaxGroup);
  if (!n) return;
  GACTX_DISPATCH(x.scalar_type(), quantize_impl<scalar>(x.data_ptr<scalar>(), n, codes, meta, int(bits), group,
                 stochastic, seed, float(factor), float(factor_special)));
}

at::Tensor dequantize(at::Tensor codes, at::Tensor meta, at::IntArrayRef shape, at::ScalarType dtype, int64_t bits,
                      int64_t group) {
  TORCH_CHECK(codes.is_contiguous() && meta.is_contiguous());
  at::Tensor out = cpu_empty(shape, dtype);
  dequantize_into(codes.data_ptr<uint8_t>(), meta.data_ptr<float>(), out, bits, group);
  return out;
}

void dequantize_into(const uint8_t* codes, const float* meta, at::Tensor& out, int64_t bits, int64_t group) {
  if (!out.numel()) return;
  advise_huge_pages(out.data_ptr(), out.nbytes());
  GACTX_DISPATCH(out.scalar_type(), dequantize_impl<scalar>(codes, meta, out.data_ptr<scalar>(), out.numel(),
                 int(bits), group));
}


at::Tensor uniform_variances(at::Tensor x, int64_t group, std::vector<int64_t> widths, std::vector<double> factors,
                             std::vector<double> special_factors, int64_t stride, double scale) {
  TORCH_CHECK(x.is_contiguous() && x.device().is_cpu() && widths.size() == factors.size() &&
              widths.size() == special_factors.size() && stride >= 1);
  const int64_t n = x.numel(), groups = sampled_groups(n, group, stride), nw = int64_t(widths.size());
  std::vector<double> partial(static_cast<size_t>(groups * nw));  // every entry written
  if (n) {
    GACTX_DISPATCH(x.scalar_type(), uniform_variances_impl<scalar>(x.data_ptr<scalar>(), n, group, stride, widths,
                   factors, special_factors, partial.data()));
  }
  return scaled_sums(partial, nw, scale);
}

}  // namespace gactx
