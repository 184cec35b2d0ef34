// The normal scheme: normal-fitted levels, a group's knots from its range, centre and spread (normal.py).
#include "common.h"
#include "kernels.h"

namespace gactx {
namespace {

// The normal scheme (normal.py): a group's metadata words, knots and codes in the float32 operations of the torch
// twin (_encode_meta, _torch_knots, _codes, _levels), in its order. Where the twin divides a Python number by a
// tensor, torch computes reciprocal(t) * number: so does this code (1 / span, then times 65536).
constexpr float kFraction = 65536.0f;       // C and D in 1/65536 of the range
constexpr float kInvFraction = 1.0f / 65536.0f;
constexpr int kDevShift = 6;                // deviations in 1/1024 of the range: their squares sum in int32

struct NormalShape {  // normal.py's _factors(bits), float32, and the intervals a tail
  float k, share, tail, last_tail, inner_both, inner_no_lower, last_with_lower, last_alone, last_special;
  int tails;
};

struct Knots {  // a group's segments: origins a, steps s, first codes j, intervals n
  float scale, a0, a1, a2, s0, s1, s2;
  int j1, j2, n0, n1, n2;
};

inline float at_least_min_step(float v) { return v < kMinStep ? kMinStep : v; }  // NaN stays NaN (torch.clamp)

inline bool finite(float v) { return (bits_of(v) & 0x7F800000u) != 0x7F800000u; }

Knots normal_knots(float lo, float hi, int32_t c16, int32_t d16, bool special, int L, const NormalShape& f) {
  Knots t;
  const float base = special ? -hi : lo;
  t.scale = hi - base <= kFltMax ? 1.0f : 0.25f;
  t.a0 = base * t.scale;
  const float top = hi * t.scale;
  const float unit = (top - t.a0) * kInvFraction;
  const float centre = t.a0 + float(c16) * unit;
  const float spread = float(d16) * unit;
  const float b1 = centre - spread * f.k, b2 = centre + spread * f.k;
  const float inner = (b2 - b1) * f.share;
  const bool lower = (b1 - t.a0) > inner && !special;  // a tail narrower than inner intervals is empty
  const bool upper = (top - b2) > inner && !special;
  t.n0 = lower ? f.tails : 0;
  t.n2 = upper ? f.tails : 0;
  t.n1 = special ? L - 1 : L - t.n0 - t.n2;
  t.s0 = lower ? at_least_min_step((b1 - t.a0) * f.tail) : 0.0f;
  t.a1 = t.a0 + float(t.n0) * t.s0;
  const float f_inner = lower ? f.inner_both : f.inner_no_lower;
  const float f_last = special ? f.last_special : (lower ? f.last_with_lower : f.last_alone);
  const float w1 = (upper ? b2 : top) - t.a1;
  t.s1 = w1 > 0.0f ? at_least_min_step(w1 * (upper ? f_inner : f_last)) : 0.0f;
  t.a2 = t.a1 + float(t.n1) * t.s1;
  const float w2 = top - t.a2;
  t.s2 = (upper && w2 > 0.0f) ? at_least_min_step(w2 * f.last_tail) : 0.0f;
  t.j1 = t.n0;
  t.j2 = t.n0 + t.n1;
  return t;
}

struct Fit {  // what a group's metadata holds: its ends, and its centre and deviation in 16-bit fixed point
  float lo, hi;
  int32_t c16, d16;
  bool special;
};

// A group's fit from its m values v and their range: mean and deviation in fixed point, each element's fraction of
// the range in u (m int32), integer sums (normal.py's _encode_meta).
Fit fit_group(const float* v, int64_t m, const GroupRange& range, int32_t* u) {
  const float fmin = range.fmin + 0.0f, fmax = range.fmax + 0.0f;  // -0 as +0
  const bool special = range.special();
  const float lo = special ? 0.0f : fmin;
  const float hi = special ? std::max(-fmin, fmax) + 0.0f : fmax;
  const float base = special ? -hi : lo;
  const float scale = hi - base <= kFltMax ? 1.0f : 0.25f;
  const float a0 = base * scale;
  const float span = hi * scale - a0;
  float r = 0.0f;
  if (span > 0.0f) {
    r = (1.0f / span) * kFraction;
    r = r > kFltMax ? kFltMax : r;
  }
  int32_t total = 0;
  for (int64_t k = 0; k < m; ++k) {
    float w = (v[k] * scale - a0) * r;
    w = w > kFraction ? kFraction : w;
    u[k] = int32_t(finite(v[k]) ? w + 0.5f : 0.0f);
    total += u[k];
  }
  const int32_t count = int32_t(m);
  int32_t c16 = std::min((total + count / 2) / count, 65535);
  int32_t squares = 0;
  for (int64_t k = 0; k < m; ++k) {
    const int32_t e = (std::abs(u[k] - c16) + 32) >> kDevShift;
    squares += finite(v[k]) ? e * e : 0;
  }
  const float var = float(squares) / float(count);
  int32_t d16 = std::min(int32_t(std::sqrt(var) * 64.0f + 0.5f), 65535);
  if (special) c16 = d16 = 0;
  return Fit{lo, hi, c16, d16, special};
}

// Codes of a group's m values v (finite or not) into q, noise 1 + u from ``noise(k)``: an element's segment by two
// comparisons, then the uniform scheme's rounding inside it (normal.py's _codes).
template <typename Noise>
void normal_codes(const float* v, int64_t m, const Knots& t, int L, Noise noise, uint8_t* q) {
  const float scale = t.scale, a0 = t.a0, a1 = t.a1, a2 = t.a2;  // locals: the loop vectorizes
  const int32_t j1 = t.j1, j2 = t.j2;
  const float inv0 = t.s0 > 0.0f ? 1.0f / t.s0 : 0.0f, inv1 = t.s1 > 0.0f ? 1.0f / t.s1 : 0.0f;
  const float inv2 = t.s2 > 0.0f ? 1.0f / t.s2 : 0.0f;
  const float cap0 = float(t.n0 + 1), cap1 = float(t.n1 + 1), cap2 = float(t.n2 + 1);
  for (int64_t k = 0; k < m; ++k) {
    const float xs = v[k] * scale;
    const bool up = xs >= a2, mid = xs >= a1, fin = finite(v[k]);
    const float origin = up ? a2 : (mid ? a1 : a0);
    const float inv = up ? inv2 : (mid ? inv1 : inv0);
    const float cap = up ? cap2 : (mid ? cap1 : cap0);
    const int32_t first = up ? j2 : (mid ? j1 : 0);
    float s = (xs - origin) * inv + noise(k);
    s = cap < s ? cap : s;  // torch.minimum: NaN stays NaN
    s = fin ? s : 1.0f;
    q[k] = uint8_t(fin ? first + int32_t(s) - 1 : L);
  }
}

template <typename T>
void normal_quantize_impl(const T* x, int64_t n, uint8_t* codes, int32_t* meta, int bits, int64_t G, bool stochastic,
                          int64_t seed, const NormalShape& f) {
  const int L = (1 << bits) - 1, per_byte = 8 / bits;
  const int64_t W = G / per_byte;
  const int64_t groups = (n + G - 1) / G;
  const uint32_t k0 = uint32_t(uint64_t(seed)), k1 = uint32_t(uint64_t(seed) >> 32);
  at::parallel_for(0, groups, grain(G * int64_t(sizeof(T))), [&](int64_t g0, int64_t g1) {
    std::vector<float> v(G);
    std::vector<int32_t> u(G);
    std::vector<uint8_t> q(G);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t start = g * G, m = std::min(G, n - start);
      const T* xg = x + start;
      // The finite range and the non-finite values there are (read_group: as the uniform scheme reads them).
      const GroupRange range = read_group(xg, m, v.data());
      const Fit fit = fit_group(v.data(), m, range, u.data());
      const float lo = fit.lo, hi = fit.hi;
      const int32_t c16 = fit.c16, d16 = fit.d16;
      const bool special = fit.special;
      meta[3 * g] = int32_t(special ? bits_of(range.kind()) : bits_of(lo));
      meta[3 * g + 1] = int32_t(bits_of(hi));
      meta[3 * g + 2] = int32_t(uint32_t(c16) | (uint32_t(d16) << 16));

      const Knots t = normal_knots(lo, hi, c16, d16, special, L, f);
      if (stochastic) {
        const uint32_t high = k1 ^ uint32_t(uint64_t(start) >> 32) * 0x85EBCA77u, low = uint32_t(uint64_t(start));
        normal_codes(v.data(), m, t, L, [&](int64_t k) { return one_plus_u(k0, high, low + uint32_t(k)); }, q.data());
      } else {
        normal_codes(v.data(), m, t, L, [](int64_t) { return 1.5f; }, q.data());
      }
      for (int64_t k = m; k < G; ++k) q[k] = 0;
      uint8_t* out = codes + g * W;
      switch (bits) {
        case 2: pack_planes<2>(q.data(), out, W); break;
        case 4: pack_planes<4>(q.data(), out, W); break;
        default: pack_planes<8>(q.data(), out, W); break;
      }
    }
  });
}

template <typename T>
void normal_dequantize_impl(const uint8_t* codes, const int32_t* meta, T* out, int64_t n, int bits, int64_t G,
                            const NormalShape& f) {
  const int L = (1 << bits) - 1, per_byte = 8 / bits;
  const int64_t W = G / per_byte;
  const int64_t groups = (n + G - 1) / G;
  const float hi_out = float(std::numeric_limits<T>::max());  // finite values saturate at the output's largest
  at::parallel_for(0, groups, grain(G * int64_t(sizeof(T))), [&](int64_t g0, int64_t g1) {
    T lut[256];
    for (int64_t g = g0; g < g1; ++g) {
      const float word0 = float_of(uint32_t(meta[3 * g])), hi = float_of(uint32_t(meta[3 * g + 1]));
      const uint32_t w2 = uint32_t(meta[3 * g + 2]);
      const bool special = !std::isfinite(word0);
      const Knots t = normal_knots(special ? 0.0f : word0, hi, int32_t(w2 & 0xFFFFu), int32_t(w2 >> 16), special, L, f);
      const float unscale = t.scale < 1.0f ? 4.0f : 1.0f;
      const float a0 = t.a0, a1 = t.a1, a2 = t.a2, s0 = t.s0, s1 = t.s1, s2 = t.s2;  // locals: vectorized
      const int32_t j1 = t.j1, j2 = t.j2;
      auto level = [=](int32_t c) -> T {  // branch-free: vectorized over a plane
        const bool up = c >= j2, mid = c >= j1;
        const float origin = up ? a2 : (mid ? a1 : a0);
        const float step = up ? s2 : (mid ? s1 : s0);
        const int32_t first = up ? j2 : (mid ? j1 : 0);
        const float value = (float(c - first) * step + origin) * unscale;
        return from_float<T>(std::min(std::max(value, -hi_out), hi_out));  // NaN stays NaN, as torch.clamp
      };
      const uint8_t* in = codes + g * W;
      const int64_t start = g * G, m = std::min(G, n - start);
      if (special) {  // rare: the top code is the group's non-finite value
        for (int c = 0; c < L; ++c) lut[c] = level(c);
        lut[L] = from_float<T>(word0);
      }
      for (int p = 0; p < per_byte && p * W < m; ++p) {  // plane p: elements p * W .. p * W + W - 1
        T* o = out + start + p * W;
        const int shift = p * bits;
        const int64_t width = std::min(W, m - p * W);
        if (special) {
          for (int64_t k = 0; k < width; ++k) o[k] = lut[(in[k] >> shift) & L];
        } else {
          for (int64_t k = 0; k < width; ++k) o[k] = level(int32_t((in[k] >> shift) & L));
        }
      }
    }
  });
}

// The expected squared error of stochastic rounding at each of ``widths`` (variance.py's normal_variances): a
// group's fit once, then, a width at a time, each element's segment and step^2 f (1 - f), f the fraction of its
// position on the segment's grid (capped at the segment's intervals, as normal_codes caps). Sums in float64.
template <typename T>
void normal_variances_impl(const T* x, int64_t n, int64_t G, int64_t stride, const std::vector<int64_t>& widths,
                           const std::vector<NormalShape>& shapes, double* partial) {
  const int64_t groups = sampled_groups(n, G, stride), nw = int64_t(widths.size());
  at::parallel_for(0, groups, grain(G * int64_t(sizeof(T))), [&](int64_t g0, int64_t g1) {
    std::vector<float> v(G), steps(G), fraction(G);
    std::vector<int32_t> u(G);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t start = g * stride * G, m = std::min(G, n - start);
      const GroupRange range = read_group(x + start, m, v.data());
      const Fit fit = fit_group(v.data(), m, range, u.data());
      for (int64_t w = 0; w < nw; ++w) {
        const int L = (1 << widths[w]) - 1;
        const Knots t = normal_knots(fit.lo, fit.hi, fit.c16, fit.d16, fit.special, L, shapes[w]);
        const float inv0 = t.s0 > 0.0f ? 1.0f / t.s0 : 0.0f, inv1 = t.s1 > 0.0f ? 1.0f / t.s1 : 0.0f;
        const float inv2 = t.s2 > 0.0f ? 1.0f / t.s2 : 0.0f;
        // Each element's step and fraction of it on its segment's grid, in float32 (the clamp and s - floor(s) are
        // exact there), then step^2 f (1 - f) in float64 as before; step 0 for a non-finite element or an empty
        // segment. No branch: the loops vectorize.
        for (int64_t k = 0; k < m; ++k) {
          const float xs = v[k] * t.scale;
          const bool up = xs >= t.a2, mid = xs >= t.a1;
          const float origin = up ? t.a2 : (mid ? t.a1 : t.a0), inv = up ? inv2 : (mid ? inv1 : inv0);
          const float step = up ? t.s2 : (mid ? t.s1 : t.s0);
          const float cap = float(up ? t.n2 : (mid ? t.n1 : t.n0));
          const float s = std::min(std::max((xs - origin) * inv, 0.0f), cap);
          const bool counted = std::fabs(v[k]) <= kFltMax && step > 0.0f;  // false for NaN
          steps[k] = counted ? step : 0.0f;
          fraction[k] = counted ? s - std::floor(s) : 0.0f;
        }
        const float *st = steps.data(), *f = fraction.data();
        const double sum = lane_sum(m, [st, f](int64_t k) {
          const double step = st[k], frac = f[k];
          return step * step * frac * (1.0 - frac);
        });
        partial[g * nw + w] = t.scale < 1.0f ? 16.0 * sum : sum;
      }
    }
  });
}

}  // namespace

NormalShape normal_shape(const std::vector<double>& factors, int64_t tails) {
  TORCH_CHECK(factors.size() == 9, "normal kernels take 9 factors");
  NormalShape f;
  float* fs[] = {&f.k, &f.share, &f.tail, &f.last_tail, &f.inner_both, &f.inner_no_lower, &f.last_with_lower,
                 &f.last_alone, &f.last_special};
  for (int i = 0; i < 9; ++i) *fs[i] = float(factors[i]);  // float32 values already: exact
  f.tails = int(tails);
  return f;
}

std::tuple<at::Tensor, at::Tensor> normal_quantize(at::Tensor x, int64_t bits, int64_t group, bool stochastic,
                                                   int64_t seed, std::vector<double> factors, int64_t tails) {
  TORCH_CHECK(x.is_contiguous() && x.device().is_cpu() && (bits == 2 || bits == 4 || bits == 8));
  const NormalShape f = normal_shape(factors, tails);
  const int64_t n = x.numel(), groups = (n + group - 1) / group;
  at::Tensor codes = at::empty({groups * group * bits / 8}, at::TensorOptions().dtype(at::kByte));
  at::Tensor meta = at::empty({groups, 3}, at::TensorOptions().dtype(at::kInt));
  if (n) {
    GACTX_DISPATCH(x.scalar_type(), normal_quantize_impl<scalar>(x.data_ptr<scalar>(), n, codes.data_ptr<uint8_t>(),
                   meta.data_ptr<int32_t>(), int(bits), group, stochastic, seed, f));
  }
  return {codes, meta};
}

at::Tensor normal_variances(at::Tensor x, int64_t group, std::vector<int64_t> widths,
                            std::vector<std::vector<double>> factors, std::vector<int64_t> tails, int64_t stride,
                            double scale) {
  TORCH_CHECK(x.is_contiguous() && x.device().is_cpu() && widths.size() == factors.size() &&
              widths.size() == tails.size() && stride >= 1);
  std::vector<NormalShape> shapes;
  for (size_t w = 0; w < widths.size(); ++w) shapes.push_back(normal_shape(factors[w], tails[w]));
  const int64_t n = x.numel(), groups = sampled_groups(n, group, stride), nw = int64_t(widths.size());
  std::vector<double> partial(static_cast<size_t>(groups * nw));  // every entry written
  if (n) {
    GACTX_DISPATCH(x.scalar_type(), normal_variances_impl<scalar>(x.data_ptr<scalar>(), n, group, stride, widths,
                   shapes, partial.data()));
  }
  return scaled_sums(partial, nw, scale);
}

void normal_dequantize(at::Tensor codes, at::Tensor meta, at::Tensor out, int64_t bits, int64_t group,
                       std::vector<double> factors, int64_t tails) {
  TORCH_CHECK(codes.is_contiguous() && meta.is_contiguous() && out.is_contiguous() && meta.scalar_type() == at::kInt);
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 8);
  const int64_t groups = (out.numel() + group - 1) / group;
  TORCH_CHECK(meta.numel() >= 3 * groups && codes.numel() >= groups * group * bits / 8, "codes or metadata too short");
  const NormalShape f = normal_shape(factors, tails);
  advise_huge_pages(out.data_ptr(), out.nbytes());
  GACTX_DISPATCH(out.scalar_type(), normal_dequantize_impl<scalar>(codes.data_ptr<uint8_t>(), meta.data_ptr<int32_t>(),
                 out.data_ptr<scalar>(), out.numel(), int(bits), group, f));
}

}  // namespace gactx
