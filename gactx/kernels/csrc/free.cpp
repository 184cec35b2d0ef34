// The free estimator's two reductions (free_sensitivity.py): the rounding variance each row of a saved tensor would
// take, read as it is saved, and the gradient of each row weighted by it, read as the gradient reaches the module.
#include "common.h"
#include "kernels.h"

namespace gactx {
namespace {
// Each group's (hi - lo)^2 / 6 in float32 (the variance stochastic rounding adds to an element per unit of S(b), the
// free estimator's term; NaN where the group holds NaN, as amin and amax give it), then per row of ``rows`` equal rows
// the sum of its elements' terms, in float64: variance.row_variances.
template <typename T>
void row_variances_impl(const T* x, int64_t n, int64_t G, int64_t rows, float* out) {
  const int64_t groups = (n + G - 1) / G, row = n / rows;
  std::vector<float> term(static_cast<size_t>(groups));
  at::parallel_for(0, groups, grain(G * int64_t(sizeof(T))), [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const T* xg = x + g * G;
      const int64_t m = std::min(G, n - g * G);
      float lo = std::numeric_limits<float>::infinity(), hi = -lo;
      bool nan = false;
      for (int64_t k = 0; k < m; ++k) {
        const float f = to_float(xg[k]);
        lo = std::min(lo, f);
        hi = std::max(hi, f);
        nan |= f != f;
      }
      const float range = nan ? std::numeric_limits<float>::quiet_NaN() : hi - lo;
      term[size_t(g)] = range * range / 6.0f;
    }
  });
  for (int64_t r = 0; r < rows; ++r) {  // a row's elements, a stretch of one group at a time
    double sum = 0.0;
    for (int64_t a = r * row, b = a + row; a < b;) {
      const int64_t g = a / G, e = std::min(b, (g + 1) * G);
      sum += double(term[size_t(g)]) * double(e - a);
      a = e;
    }
    out[r] = float(sum);
  }
}

// sum_r weights[r] * ||g_r||^2 over ``rows`` equal rows of g, each row's squares summed in float64 (rows in parallel).
template <typename T>
double weighted_norms_impl(const T* g, int64_t n, const float* weights, int64_t rows) {
  const int64_t row = n / rows;
  std::vector<double> norms(static_cast<size_t>(rows));
  at::parallel_for(0, rows, grain(row * int64_t(sizeof(T))), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* gr = g + r * row;
      norms[size_t(r)] = lane_sum(row, [gr](int64_t k) {
        const double v = to_float(gr[k]);
        return v * v;
      });
    }
  });
  double sum = 0.0;
  for (int64_t r = 0; r < rows; ++r) sum += double(weights[r]) * norms[size_t(r)];
  return sum;
}

// The mean over channels of 1 / (var_c + eps), var_c the variance of channel c over x's outer and inner dimensions
// (x contiguous as [outer, channels, inner]), each from its centred values in float64: what a BatchNorm (channels: C)
// or LayerNorm (outer 1, channels: its rows) divides its input's noise by, on average.
template <typename T>
double inverse_variance_impl(const T* x, int64_t outer, int64_t channels, int64_t inner, double eps) {
  std::vector<double> inverse(static_cast<size_t>(channels));
  const int64_t count = outer * inner;
  at::parallel_for(0, channels, grain(count * int64_t(sizeof(T))), [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      double total = 0.0;
      for (int64_t o = 0; o < outer; ++o) {
        const T* xr = x + (o * channels + c) * inner;
        total += lane_sum(inner, [xr](int64_t k) { return double(to_float(xr[k])); });
      }
      const double mean = count ? total / double(count) : 0.0;
      double squares = 0.0;
      for (int64_t o = 0; o < outer; ++o) {
        const T* xr = x + (o * channels + c) * inner;
        squares += lane_sum(inner, [xr, mean](int64_t k) {
          const double d = double(to_float(xr[k])) - mean;
          return d * d;
        });
      }
      inverse[size_t(c)] = 1.0 / (squares / double(std::max<int64_t>(count, 1)) + eps);
    }
  });
  double sum = 0.0;
  for (int64_t c = 0; c < channels; ++c) sum += inverse[size_t(c)];
  return channels ? sum / double(channels) : 0.0;
}

}  // namespace

at::Tensor row_variances(at::Tensor x, int64_t group, int64_t rows) {
  TORCH_CHECK(x.is_contiguous() && x.device().is_cpu() && rows >= 1 && x.numel() % rows == 0 && group >= 1);
  at::Tensor out = at::empty({rows}, at::TensorOptions().dtype(at::kFloat));
  GACTX_DISPATCH(x.scalar_type(), row_variances_impl<scalar>(x.data_ptr<scalar>(), x.numel(), group, rows,
                 out.data_ptr<float>()));  // no element: every row 0
  return out;
}

void add_weighted_norms(at::Tensor total, at::Tensor g, at::Tensor weights) {
  TORCH_CHECK(total.is_contiguous() && total.scalar_type() == at::kFloat && total.numel() == 1 && total.device().is_cpu());
  TORCH_CHECK(weights.is_contiguous() && weights.scalar_type() == at::kFloat && weights.dim() == 1);
  TORCH_CHECK(g.is_contiguous() && g.device().is_cpu() && weights.numel() >= 1 && g.numel() % weights.numel() == 0);
  double sum = 0.0;
  GACTX_DISPATCH(g.scalar_type(), sum = weighted_norms_impl<scalar>(g.data_ptr<scalar>(), g.numel(),
                 weights.data_ptr<float>(), weights.numel()));
  float* t = total.data_ptr<float>();
  t[0] = t[0] + float(sum);
}

at::Tensor inverse_variance(at::Tensor x, int64_t outer, int64_t channels, int64_t inner, double eps) {
  TORCH_CHECK(x.is_contiguous() && x.device().is_cpu() && outer * channels * inner == x.numel());
  double mean = 0.0;
  GACTX_DISPATCH(x.scalar_type(), mean = inverse_variance_impl<scalar>(x.data_ptr<scalar>(), outer, channels, inner,
                 eps));
  at::Tensor out = at::empty({1}, at::TensorOptions().dtype(at::kFloat));
  out.data_ptr<float>()[0] = float(mean);
  return out;
}

}  // namespace gactx
