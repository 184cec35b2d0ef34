"""CPU kernels: quantize, dequantize and table codes in C++, with no temporary larger than a group a thread.

The torch twins (``quantize.py``, ``dequantize.py``, ``normal.py``, ``codes.py``, ``bitmask.py``) are written
for clarity and as the test oracle: about 60 full-size ATen passes a call, and temporaries several times the
tensor (a padded float32 copy, an index tensor, int32 codes), which is what an allocator's peak sees. On a CPU
the same arithmetic runs here instead: one pass to find each group's range and one to write its codes (the
normal scheme: two more, for the sums of its fractions and deviations), a group at a time per thread
(``at::parallel_for`` over groups, torch's intra-op threads). A large decoded output is advised to use
transparent huge pages before it is written (``advise_huge_pages``): a fresh buffer otherwise costs a page
fault every 4 KiB.

Same bytes as the twins: the same float32 operations in the same order, compiled without fused multiply-add
(``-ffp-contract=off``) or fast-math. With ``stochastic=True`` the noise comes from a counter-based hash of
``(seed, element index)`` (murmur3's finalizer, twice), not from ``torch.rand``: 23 uniform bits an element,
so the rounding is unbiased as before, but the codes differ from the twin's.

The extension is compiled on first use with ``torch.utils.cpp_extension.load_inline`` (about 40 s on 2
cores, once; cached under torch's extensions folder, rebuilt when this source changes) for the machine it
runs on (``-march=native``). Where it cannot be built (no C++ compiler, no ninja), a warning says so and the
torch twins run: slower, with their temporaries, same results.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
import threading
import warnings

import torch

from gactx.kernels.format import expected_nbytes
from gactx.kernels.normal import SHAPES
from gactx.kernels.normal import _factors as _normal_factors
from gactx.kernels.quantize import step_factor

__all__ = [
    "available", "extension", "quantize", "dequantize", "normal_quantize", "normal_dequantize", "encode_bins",
    "decode_table", "pack_bool", "pack_compare", "unpack_bool",
]  # fmt: skip

log = logging.getLogger("gactx")

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <atomic>
#include <mutex>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#ifdef __linux__
#include <sys/mman.h>
#endif

namespace {

constexpr float kFltMax = 3.4028234663852886e38f;
constexpr float kMinStep = 1.1754943508222875e-38f;  // 2**-126
constexpr int64_t kGrainBytes = 1 << 16;              // work a task at least: about 64 KiB of input

inline uint32_t bits_of(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
inline float float_of(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return float_of(uint32_t(v.x) << 16); }
inline float to_float(at::Half v) { return static_cast<float>(v); }

template <typename T> inline T from_float(float v) { return static_cast<T>(v); }  // round to nearest even

inline uint32_t fmix(uint32_t h) {  // murmur3's finalizer
  h ^= h >> 16; h *= 0x85EBCA6Bu; h ^= h >> 13; h *= 0xC2B2AE35u; h ^= h >> 16;
  return h;
}

// 1 + u, u uniform on [0, 1) with 23 bits, from (seed, element index i): ``high`` is
// k1 ^ uint32(i >> 32) * 0x85EBCA77, the same for every element of a group (a group never crosses 2**32).
inline float one_plus_u(uint32_t k0, uint32_t high, uint32_t low) {
  const uint32_t h = fmix(fmix(low * 0x9E3779B9u ^ k0) ^ high);
  return float_of(0x3F800000u | (h >> 9));
}

// A group's codes (one a byte) into its packed bytes: byte k holds code p * W + k in bits p * BITS (the
// planes of format.py). BITS a constant, so that the compiler unrolls the planes and vectorizes over k.
template <int BITS>
void pack_planes(const uint8_t* __restrict q, uint8_t* __restrict out, int64_t W) {
  constexpr int P = 8 / BITS;
  for (int64_t k = 0; k < W; ++k) {
    uint8_t byte = q[k];
    for (int p = 1; p < P; ++p) byte |= uint8_t(q[p * W + k] << (p * BITS));
    out[k] = byte;
  }
}

// A float's bits as an int32 that sorts like the float (-0 before +0); its own inverse.
inline int32_t sortable(uint32_t b) { return int32_t(b ^ (uint32_t(int32_t(b) >> 31) & 0x7FFFFFFFu)); }

// Transparent huge pages for the 2 MiB-aligned part of a large output, asked before it is first written (what
// torch's own allocator does under THP_MEM_ALLOC_ENABLE=1). A fresh buffer, which a large output is on every
// call, otherwise takes a page fault every 4 KiB, and those cost about as much as writing it. Advice only:
// where the kernel does not take it (THP "never", not Linux) nothing changes.
void advise_huge_pages(void* p, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  if (bytes < 4 * int64_t(kHuge)) return;
  const uintptr_t a = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t b = (reinterpret_cast<uintptr_t>(p) + uintptr_t(bytes)) & ~(kHuge - 1);
  if (b > a) madvise(reinterpret_cast<void*>(a), b - a, MADV_HUGEPAGE);
#endif
}

int64_t grain(int64_t group_bytes) { return std::max<int64_t>(1, kGrainBytes / std::max<int64_t>(1, group_bytes)); }

template <typename T>
void quantize_impl(const T* x, int64_t n, uint8_t* codes, float* meta, int bits, int64_t G, bool stochastic,
                   int64_t seed, float factor, float factor_special) {
  const int L = (1 << bits) - 1, centre = (L - 1) / 2, per_byte = 8 / bits;
  const int64_t W = G / per_byte;  // bytes a group
  const int64_t groups = (n + G - 1) / G;
  const uint32_t k0 = uint32_t(uint64_t(seed)), k1 = uint32_t(uint64_t(seed) >> 32);
  const float top = float(L + 1);
  at::parallel_for(0, groups, grain(G * int64_t(sizeof(T))), [&](int64_t g0, int64_t g1) {
    std::vector<float> v(G);
    std::vector<uint8_t> q(G);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t start = g * G, m = std::min(G, n - start);
      const T* xg = x + start;
      int32_t smin = std::numeric_limits<int32_t>::max(), smax = std::numeric_limits<int32_t>::min();
      uint32_t nonfinite = 0;
      for (int64_t k = 0; k < m; ++k) {
        const float f = to_float(xg[k]);
        v[k] = f;
        const uint32_t b = bits_of(f);
        const int32_t s = sortable(b);
        smin = std::min(smin, s);
        smax = std::max(smax, s);
        nonfinite |= uint32_t((b & 0x7F800000u) == 0x7F800000u);
      }
      bool has_nan = false, has_pinf = false, has_ninf = false;
      float fmin, fmax;
      if (!nonfinite) {
        fmin = float_of(uint32_t(sortable(uint32_t(smin))));
        fmax = float_of(uint32_t(sortable(uint32_t(smax))));
      } else {  // rare: the finite range, and which non-finite values there are
        fmin = std::numeric_limits<float>::infinity();
        fmax = -fmin;
        for (int64_t k = 0; k < m; ++k) {
          const float f = v[k];
          if (std::isnan(f)) has_nan = true;
          else if (std::isinf(f)) (f > 0 ? has_pinf : has_ninf) = true;
          else { fmin = std::min(fmin, f); fmax = std::max(fmax, f); }
        }
        if (!(fmin < std::numeric_limits<float>::infinity())) fmin = 0.0f;
        if (!(fmax > -std::numeric_limits<float>::infinity())) fmax = 0.0f;
      }
      const bool special = has_nan || has_pinf || has_ninf;
      const float span = special ? 2.0f * std::max(-fmin, fmax) : fmax - fmin;
      // A finite group whose span overflowed: step = fmax * f - fmin * f, elements encoded at a quarter
      // of their value (quantize.py).
      const float scale = (special || span <= kFltMax) ? 1.0f : 0.25f;
      const float f = special ? factor_special : factor;
      float step = std::min(scale < 1.0f ? fmax * f - fmin * f : span * f, kFltMax);
      step = span > 0.0f ? std::max(step, kMinStep) : 0.0f;
      if (L == 1 && special) step = 0.0f;
      const float inv = step > 0.0f ? 1.0f / (step * scale) : 0.0f;
      const float inf = std::numeric_limits<float>::infinity();
      const float kind = (has_nan || (has_pinf && has_ninf)) ? std::numeric_limits<float>::quiet_NaN()
                                                             : (has_pinf ? inf : -inf);
      const float origin = (special ? 0.0f : fmin) * scale;
      const float shift = special ? float(centre) : 0.0f;
      meta[2 * g] = special ? kind : fmin;
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
        case 1: pack_planes<1>(q.data(), out, W); break;
        case 2: pack_planes<2>(q.data(), out, W); break;
        case 4: pack_planes<4>(q.data(), out, W); break;
        default: pack_planes<8>(q.data(), out, W); break;
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
      // Halves where q * step can overflow while the value does not (dequantize.py).
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
      // The finite range and the non-finite values there are, as the uniform kernel finds them.
      int32_t smin = std::numeric_limits<int32_t>::max(), smax = std::numeric_limits<int32_t>::min();
      uint32_t nonfinite = 0;
      for (int64_t k = 0; k < m; ++k) {
        const float fk = to_float(xg[k]);
        v[k] = fk;
        const uint32_t b = bits_of(fk);
        const int32_t s = sortable(b);
        smin = std::min(smin, s);
        smax = std::max(smax, s);
        nonfinite |= uint32_t((b & 0x7F800000u) == 0x7F800000u);
      }
      bool has_nan = false, has_pinf = false, has_ninf = false;
      float fmin, fmax;
      if (!nonfinite) {
        fmin = float_of(uint32_t(sortable(uint32_t(smin))));
        fmax = float_of(uint32_t(sortable(uint32_t(smax))));
      } else {
        fmin = std::numeric_limits<float>::infinity();
        fmax = -fmin;
        for (int64_t k = 0; k < m; ++k) {
          const float fk = v[k];
          if (std::isnan(fk)) has_nan = true;
          else if (std::isinf(fk)) (fk > 0 ? has_pinf : has_ninf) = true;
          else { fmin = std::min(fmin, fk); fmax = std::max(fmax, fk); }
        }
        if (!(fmin < std::numeric_limits<float>::infinity())) fmin = 0.0f;
        if (!(fmax > -std::numeric_limits<float>::infinity())) fmax = 0.0f;
      }
      fmin = fmin + 0.0f;  // -0 as +0
      fmax = fmax + 0.0f;
      const bool special = has_nan || has_pinf || has_ninf;
      const float lo = special ? 0.0f : fmin;
      const float hi = special ? std::max(-fmin, fmax) + 0.0f : fmax;

      // Mean and deviation in fixed point: each element's fraction U of the range, integer sums (int32).
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
      const uint32_t kind = (has_nan || (has_pinf && has_ninf)) ? 0x7FC00000u : (has_pinf ? 0x7F800000u : 0xFF800000u);
      meta[3 * g] = int32_t(special ? kind : bits_of(lo));
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

// torch.bucketize (right=False) of sorted edges is the count of edges that are not >= the value (NaN: all of
// them, past the last edge). With 2**BITS - 1 edges (a FewBit table's, BITS <= 4) that count is taken edge by
// edge over a block of values: no branch, and the compiler vectorizes it (a binary search mispredicts at every
// level).
template <typename T, int BITS>
void encode_bins_counted(const T* x, int64_t n, const float* e, uint8_t* packed) {
  constexpr int P = 8 / BITS, C = (1 << BITS) - 1;
  constexpr int64_t kBlock = 512;  // values a block: a multiple of P
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, grain(kBlock * int64_t(sizeof(T))), [&](int64_t b0, int64_t b1) {
    float v[kBlock];
    uint8_t q[kBlock];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t start = b * kBlock, m = std::min(kBlock, n - start);
      for (int64_t k = 0; k < m; ++k) v[k] = to_float(x[start + k]);
      for (int64_t k = m; k < kBlock; ++k) v[k] = 0.0f;
      for (int64_t k = 0; k < kBlock; ++k) q[k] = 0;
      for (int j = 0; j < C; ++j) {
        const float edge = e[j];
        for (int64_t k = 0; k < kBlock; ++k) q[k] += uint8_t(!(edge >= v[k]));
      }
      for (int64_t k = m; k < kBlock; ++k) q[k] = 0;  // the codes past the end of the tensor are 0
      uint8_t* out = packed + start / P;
      const int64_t bytes = (m + P - 1) / P;
      for (int64_t i = 0; i < bytes; ++i) {
        uint8_t byte = 0;
        for (int p = 0; p < P; ++p) byte |= uint8_t(q[i * P + p] << (p * BITS));
        out[i] = byte;
      }
    }
  });
}

// With 255 edges (8 bits) counting edge by edge costs 255 comparisons a value. A value's cell on a uniform grid
// over the edges' range narrows its count instead. The cell is computed in float32, ((v - first) * inv), which
// never decreases as v grows: so an edge whose cell is below v's is below v, and one whose cell is above v's is
// above it. The count of a value of cell c is then lut[c] (the edges of lower cells) plus the count of the edges of
// cell c below it, whatever the rounding. Cells are made narrow enough (up to kCells of them) that each holds at
// most one edge, its value kept beside the count (+inf in an empty cell): one comparison finishes the count. Where
// edges crowd closer than that (a tanh table's, at +-1), a branchless binary search of the cell's edges does (the
// same steps for every value: no branch to mispredict). Exactly torch.bucketize: NaN past the last edge, -inf at
// 0, +inf past the last.
struct BinCell {
  int32_t below;  // edges in lower cells
  float edge;  // the cell's one edge, or +inf (cells of one edge at most)
};

template <typename T>
void bins_by_cell(const T* x, int64_t n, const BinCell* cells, int64_t count, float first, float inv, float top,
                  uint8_t* packed) {
  at::parallel_for(0, n, grain(int64_t(sizeof(T))), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float v = to_float(x[i]);
      // std::max(0, NaN) is 0 (it returns its first argument unless that is less); NaN's code is set below
      const BinCell& c = cells[int32_t(std::min(top, std::max(0.0f, (v - first) * inv)))];
      const int32_t code = c.below + int32_t(!(c.edge >= v));
      packed[i] = uint8_t(v == v ? code : int32_t(count));
    }
  });
}

template <typename T, int STEPS>
void bins_searched(const T* x, int64_t n, const float* e, const int32_t* lut, int64_t count, float first, float inv,
                   float top, uint8_t* packed) {
  at::parallel_for(0, n, grain(int64_t(sizeof(T))), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float v = to_float(x[i]);
      int32_t code = lut[int32_t(std::min(top, std::max(0.0f, (v - first) * inv)))];
      for (int32_t step = 1 << (STEPS - 1); step > 0; step >>= 1) code += !(e[code + step - 1] >= v) ? step : 0;
      packed[i] = uint8_t(v == v ? code : int32_t(count));
    }
  });
}

template <typename T>
void encode_bins_lut(const T* x, int64_t n, const std::vector<float>& edges, uint8_t* packed) {
  constexpr int64_t kCells = 1 << 16;
  const int64_t count = int64_t(edges.size());
  const float first = edges[0], range = edges[count - 1] - edges[0];
  float gap = range;
  for (int64_t j = 1; j < count; ++j) {
    if (edges[j] > edges[j - 1]) gap = std::min(gap, edges[j] - edges[j - 1]);
  }
  // Two cells a gap: a cell then holds one edge at most, but for roundings (then the cells double, once).
  int64_t cells = std::max<int64_t>(1, std::min<int64_t>(kCells, 2 * int64_t(std::ceil(range / gap)) + 1));
  std::vector<int64_t> in_cell;
  float inv = 0.0f;
  int64_t window = 0;
  for (int attempt = 0;; ++attempt) {
    inv = float(cells) / range;
    in_cell.assign(cells + 1, 0);
    for (int64_t j = 0; j < count; ++j) {
      ++in_cell[int64_t(std::min(float(cells), std::max(0.0f, (edges[j] - first) * inv)))];
    }
    window = *std::max_element(in_cell.begin(), in_cell.end());
    if (window <= 1 || cells >= kCells || attempt == 1) break;
    cells = std::min(kCells, 2 * cells);
  }
  const float top = float(cells);
  if (window <= 1) {
    std::vector<BinCell> table(cells + 1, BinCell{0, INFINITY});
    int32_t below = 0;
    for (int64_t c = 0, j = 0; c <= cells; ++c) {
      table[c].below = below;
      if (in_cell[c]) table[c].edge = edges[j++];
      below += int32_t(in_cell[c]);
    }
    bins_by_cell<T>(x, n, table.data(), count, first, inv, top, packed);
    return;
  }
  std::vector<int32_t> lut(cells + 1);
  int32_t below = 0;
  for (int64_t c = 0; c <= cells; ++c) {
    lut[c] = below;
    below += int32_t(in_cell[c]);
  }
  int steps = 0;
  while ((int64_t(1) << steps) <= window) ++steps;  // the search covers [lut, lut + 2**steps - 1]
  std::vector<float> e(edges);
  e.resize(count + (int64_t(1) << steps), INFINITY);  // the search may look past the last edge
  switch (steps) {  // the search unrolled: a constant number of steps
    case 2: return bins_searched<T, 2>(x, n, e.data(), lut.data(), count, first, inv, top, packed);
    case 3: return bins_searched<T, 3>(x, n, e.data(), lut.data(), count, first, inv, top, packed);
    case 4: return bins_searched<T, 4>(x, n, e.data(), lut.data(), count, first, inv, top, packed);
    case 5: return bins_searched<T, 5>(x, n, e.data(), lut.data(), count, first, inv, top, packed);
    case 6: return bins_searched<T, 6>(x, n, e.data(), lut.data(), count, first, inv, top, packed);
    case 7: return bins_searched<T, 7>(x, n, e.data(), lut.data(), count, first, inv, top, packed);
    default: return bins_searched<T, 8>(x, n, e.data(), lut.data(), count, first, inv, top, packed);
  }
}

template <typename T>
void encode_bins_impl(const T* x, int64_t n, const T* edges, int64_t count, uint8_t* packed, int bits) {
  const int per_byte = 8 / bits;
  const int64_t bytes = (n + per_byte - 1) / per_byte;
  std::vector<float> e(count);
  for (int64_t j = 0; j < count; ++j) e[j] = to_float(edges[j]);
  if (count == (1 << bits) - 1 && (bits == 1 || bits == 2 || bits == 4)) {
    if (bits == 1) encode_bins_counted<T, 1>(x, n, e.data(), packed);
    else if (bits == 2) encode_bins_counted<T, 2>(x, n, e.data(), packed);
    else encode_bins_counted<T, 4>(x, n, e.data(), packed);
    return;
  }
  bool finite = count > 1;
  for (int64_t j = 0; j < count && finite; ++j) finite = std::isfinite(e[j]) && (j == 0 || e[j] >= e[j - 1]);
  if (bits == 8 && finite && e[count - 1] > e[0]) {
    encode_bins_lut<T>(x, n, e, packed);
    return;
  }
  at::parallel_for(0, bytes, grain(per_byte * int64_t(sizeof(T))), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      uint8_t byte = 0;
      for (int k = 0; k < per_byte; ++k) {
        const int64_t i = b * per_byte + k;
        if (i >= n) break;
        const float f = to_float(x[i]);
        int64_t lo = 0, hi = count;  // torch.bucketize (right=False): the first edge that is >= f; NaN: past all
        while (lo < hi) {
          const int64_t mid = lo + ((hi - lo) >> 1);
          if (!(e[mid] >= f)) lo = mid + 1; else hi = mid;
        }
        byte |= uint8_t(lo << (k * bits));
      }
      packed[b] = byte;
    }
  });
}

// BITS a constant: the divisions become shifts. Below 8 bits each of the 256 bytes' P values are looked up
// once (at most 8 KiB), and a whole byte decodes as one copy of P values.
template <typename T, int BITS>
void decode_table_bits(const uint8_t* __restrict packed, const T* table, T* __restrict out, int64_t n) {
  constexpr int P = 8 / BITS, M = (1 << BITS) - 1;
  T lut[1 << BITS];
  for (int c = 0; c <= M; ++c) lut[c] = table[c];
  std::vector<T> wide(P > 1 ? 256 * P : 0);
  for (int byte = 0; P > 1 && byte < 256; ++byte)
    for (int k = 0; k < P; ++k) wide[byte * P + k] = lut[(byte >> (k * BITS)) & M];
  const int64_t whole = n / P;  // bytes all of whose codes are elements
  at::parallel_for(0, whole, kGrainBytes / int64_t(P * sizeof(T)), [&](int64_t b0, int64_t b1) {
    if (P == 1) {
      for (int64_t b = b0; b < b1; ++b) out[b] = lut[packed[b]];
    } else {
      const T* w = wide.data();
      for (int64_t b = b0; b < b1; ++b) std::memcpy(out + b * P, w + packed[b] * P, P * sizeof(T));
    }
  });
  for (int64_t i = whole * P; i < n; ++i) out[i] = lut[(packed[i / P] >> ((i % P) * BITS)) & M];
}

template <typename T>
void decode_table_impl(const uint8_t* packed, const T* table, T* out, int64_t n, int bits) {
  switch (bits) {
    case 1: decode_table_bits<T, 1>(packed, table, out, n); break;
    case 2: decode_table_bits<T, 2>(packed, table, out, n); break;
    case 4: decode_table_bits<T, 4>(packed, table, out, n); break;
    default: decode_table_bits<T, 8>(packed, table, out, n); break;
  }
}

// Eight 0/1 bytes (element i in byte i) as one byte, element i in bit i: the multiply moves byte i's bit to
// bit 56 + i, with no two partial products on one bit (no carries).
inline uint8_t pack8(const uint8_t* b) {
  uint64_t v;
  std::memcpy(&v, b, 8);
  return uint8_t((v * 0x0102040810204080ull) >> 56);
}

void pack_bool_impl(const uint8_t* __restrict mask, int64_t n, uint8_t* __restrict packed) {
  const int64_t whole = n / 8;  // bytes of 8 elements
  at::parallel_for(0, whole, kGrainBytes / 8, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) packed[b] = pack8(mask + b * 8);  // a bool's byte is 0 or 1
  });
  if (whole * 8 < n) {
    uint8_t byte = 0;
    for (int64_t i = whole * 8; i < n; ++i) byte |= uint8_t((mask[i] & 1) << (i - whole * 8));
    packed[whole] = byte;
  }
}

// The op's own test of an element against its bounds (float32 bounds; a 16-bit tensor's bounds are exact in
// its dtype, so comparing in float32 is comparing in it): KIND 0 v > lo, 1 lo < v < hi, 2 not lo <= v <= hi,
// 3 lo <= v <= hi, 4 v >= lo, 5 v <= hi. NaN fails every test but 2's, as in torch.
template <int KIND>
inline bool compare(float v, float lo, float hi) {
  if (KIND == 0) return v > lo;
  if (KIND == 1) return (v > lo) & (v < hi);
  if (KIND == 2) return !((v >= lo) & (v <= hi));
  if (KIND == 3) return (v >= lo) & (v <= hi);
  if (KIND == 4) return v >= lo;
  return v <= hi;
}

// The test's result packed 8 to a byte (pack_bool's layout), with no bool tensor between: tested a block at a
// time into bytes (a loop the compiler vectorizes), then packed.
template <typename T, int KIND>
void pack_compare_kind(const T* __restrict x, int64_t n, uint8_t* __restrict packed, float lo, float hi) {
  constexpr int64_t kBlock = 512;  // elements a block: 64 packed bytes
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / int64_t(kBlock * sizeof(T)));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    alignas(64) uint8_t q[kBlock];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t start = b * kBlock, m = std::min(kBlock, n - start);
      const T* xb = x + start;
      for (int64_t k = 0; k < m; ++k) q[k] = uint8_t(compare<KIND>(to_float(xb[k]), lo, hi));
      for (int64_t k = m; k < kBlock; ++k) q[k] = 0;
      uint8_t* out = packed + start / 8;
      const int64_t bytes = (m + 7) / 8;
      for (int64_t j = 0; j < bytes; ++j) out[j] = pack8(q + 8 * j);
    }
  });
}

template <typename T>
void pack_compare_impl(const T* x, int64_t n, uint8_t* packed, int kind, float lo, float hi) {
  switch (kind) {
    case 0: pack_compare_kind<T, 0>(x, n, packed, lo, hi); break;
    case 1: pack_compare_kind<T, 1>(x, n, packed, lo, hi); break;
    case 2: pack_compare_kind<T, 2>(x, n, packed, lo, hi); break;
    case 3: pack_compare_kind<T, 3>(x, n, packed, lo, hi); break;
    case 4: pack_compare_kind<T, 4>(x, n, packed, lo, hi); break;
    default: pack_compare_kind<T, 5>(x, n, packed, lo, hi); break;
  }
}

void unpack_bool_impl(const uint8_t* packed, int64_t n, uint8_t* mask) {
  at::parallel_for(0, n, kGrainBytes, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) mask[i] = (packed[i >> 3] >> (i & 7)) & 1;
  });
}

#define GACTX_DISPATCH(DTYPE, FN, ...)                                                    \
  switch (DTYPE) {                                                                        \
    case at::kFloat: { using scalar = float; FN; break; }                                 \
    case at::kBFloat16: { using scalar = at::BFloat16; FN; break; }                      \
    case at::kHalf: { using scalar = at::Half; FN; break; }                               \
    default: TORCH_CHECK(false, "gactx CPU kernels take float32, bfloat16 or float16, not ", DTYPE); \
  }

}  // namespace

// Outputs are allocated here: from Python each allocation costs more than a small tensor's kernel.
std::tuple<at::Tensor, at::Tensor> quantize(at::Tensor x, int64_t bits, int64_t group, bool stochastic, int64_t seed,
                                            double factor, double factor_special) {
  TORCH_CHECK(x.is_contiguous() && x.device().is_cpu());
  const int64_t n = x.numel(), groups = (n + group - 1) / group;
  at::Tensor codes = at::empty({groups * group * bits / 8}, at::TensorOptions().dtype(at::kByte));
  at::Tensor meta = at::empty({groups, 2}, at::TensorOptions().dtype(at::kFloat));
  if (n) {
    GACTX_DISPATCH(x.scalar_type(), quantize_impl<scalar>(x.data_ptr<scalar>(), n, codes.data_ptr<uint8_t>(),
                   meta.data_ptr<float>(), int(bits), group, stochastic, seed, float(factor), float(factor_special)));
  }
  return {codes, meta};
}

void dequantize(at::Tensor codes, at::Tensor meta, at::Tensor out, int64_t bits, int64_t group) {
  TORCH_CHECK(codes.is_contiguous() && meta.is_contiguous() && out.is_contiguous());
  advise_huge_pages(out.data_ptr(), out.nbytes());
  GACTX_DISPATCH(out.scalar_type(), dequantize_impl<scalar>(codes.data_ptr<uint8_t>(), meta.data_ptr<float>(),
                 out.data_ptr<scalar>(), out.numel(), int(bits), group));
}

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

void encode_bins(at::Tensor x, at::Tensor edges, at::Tensor packed, int64_t bits) {
  TORCH_CHECK(x.is_contiguous() && edges.is_contiguous() && packed.is_contiguous());
  TORCH_CHECK(edges.scalar_type() == x.scalar_type());
  GACTX_DISPATCH(x.scalar_type(), encode_bins_impl<scalar>(x.data_ptr<scalar>(), x.numel(),
                 edges.data_ptr<scalar>(), edges.numel(), packed.data_ptr<uint8_t>(), int(bits)));
}

void pack_bool(at::Tensor mask, at::Tensor packed) {
  TORCH_CHECK(mask.is_contiguous() && packed.is_contiguous() && mask.scalar_type() == at::kBool);
  pack_bool_impl(reinterpret_cast<const uint8_t*>(mask.data_ptr<bool>()), mask.numel(), packed.data_ptr<uint8_t>());
}

at::Tensor pack_compare(at::Tensor x, int64_t kind, double lo, double hi) {
  TORCH_CHECK(x.is_contiguous() && x.device().is_cpu() && kind >= 0 && kind <= 5);
  at::Tensor packed = at::empty({(x.numel() + 7) / 8}, at::TensorOptions().dtype(at::kByte));
  GACTX_DISPATCH(x.scalar_type(), pack_compare_impl<scalar>(x.data_ptr<scalar>(), x.numel(),
                 packed.data_ptr<uint8_t>(), int(kind), float(lo), float(hi)));
  return packed;
}

void unpack_bool(at::Tensor packed, at::Tensor mask) {
  TORCH_CHECK(mask.is_contiguous() && packed.is_contiguous() && mask.scalar_type() == at::kBool);
  advise_huge_pages(mask.data_ptr(), mask.nbytes());
  unpack_bool_impl(packed.data_ptr<uint8_t>(), mask.numel(), reinterpret_cast<uint8_t*>(mask.data_ptr<bool>()));
}

void decode_table(at::Tensor packed, at::Tensor table, at::Tensor out, int64_t bits) {
  TORCH_CHECK(packed.is_contiguous() && table.is_contiguous() && out.is_contiguous());
  TORCH_CHECK(table.scalar_type() == out.scalar_type());
  advise_huge_pages(out.data_ptr(), out.nbytes());
  GACTX_DISPATCH(out.scalar_type(), decode_table_impl<scalar>(packed.data_ptr<uint8_t>(), table.data_ptr<scalar>(),
                 out.data_ptr<scalar>(), out.numel(), int(bits)));
}

// ---------------------------------------------------------------------------------------------------------------------
// Ops for compiled graphs (gactx_cpu::*_saved): a graph's own code calls them through the dispatcher, with no Python.
// Each logs that a save ran (its token and shape) and returns one tensor, what it stores, from a buffer of torch's CPU
// allocator (what torch's memory accounting sees) whose release logs that too (its backward ran, or the graph was
// dropped); a save kept as it is returns a one-byte marker alike. The controller reads the log when it next looks at
// its passes (compiled.py). One output a save: each output costs the graph's code a Python tensor, a size check and
// a saved tensor of AOTAutograd's. Seeds of stochastic rounding come from a counter here: a new one at every call,
// mixed with the caller's salt.
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
// buffer is freed.
at::Tensor logged_buffer(const at::Tensor& t, int64_t token, int64_t nbytes) {
  nbytes = std::max<int64_t>(nbytes, 1);
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

int64_t next_seed(int64_t salt) {  // as traced.py's draws: ((draw * golden) ^ (salt * c)) mod 2**62
  const uint64_t draw = draws.fetch_add(1) + 1;
  const uint64_t mixed = (draw * 0x9E3779B97F4A7C15ull) ^ (uint64_t(salt) * 0xC2B2AE3D27D4EB4Full);
  return int64_t(mixed & ((uint64_t(1) << 62) - 1));
}

int64_t code_bytes(int64_t n, int64_t bits, int64_t group) { return (n + group - 1) / group * group * bits / 8; }

}  // namespace

// Codes then the groups' (lo, step) in one buffer: ``code_bytes`` bytes, a multiple of 4, then 8 bytes a group.
at::Tensor quantize_saved(const at::Tensor& t, int64_t bits, int64_t group, bool stochastic, int64_t salt,
                          int64_t token, double factor, double factor_special) {
  const at::Tensor x = t.reshape(-1).contiguous();
  const int64_t n = x.numel(), groups = (n + group - 1) / group, codes = code_bytes(n, bits, group);
  at::Tensor out = logged_buffer(t, token, codes + groups * 8);
  uint8_t* data = out.data_ptr<uint8_t>();
  if (n) {
    const int64_t seed = stochastic ? next_seed(salt) : 0;
    GACTX_DISPATCH(x.scalar_type(), quantize_impl<scalar>(x.data_ptr<scalar>(), n, data,
                   reinterpret_cast<float*>(data + codes), int(bits), group, stochastic, seed, float(factor),
                   float(factor_special)));
  }
  return out;
}

at::Tensor dequantize_saved(const at::Tensor& stored, int64_t bits, int64_t group, int64_t n, at::ScalarType dtype) {
  TORCH_CHECK(stored.is_contiguous() && stored.scalar_type() == at::kByte);
  at::Tensor out = at::empty({n}, at::TensorOptions().dtype(dtype));
  if (n) {
    const uint8_t* data = stored.data_ptr<uint8_t>();
    const float* meta = reinterpret_cast<const float*>(data + code_bytes(n, bits, group));
    advise_huge_pages(out.data_ptr(), out.nbytes());
    GACTX_DISPATCH(dtype, dequantize_impl<scalar>(data, meta, out.data_ptr<scalar>(), n, int(bits), group));
  }
  return out;
}

at::Tensor pack_bool_saved(const at::Tensor& t, int64_t token) {
  const at::Tensor mask = t.reshape(-1).contiguous();
  at::Tensor packed = logged_buffer(t, token, (mask.numel() + 7) / 8);
  pack_bool_impl(reinterpret_cast<const uint8_t*>(mask.data_ptr<bool>()), mask.numel(), packed.data_ptr<uint8_t>());
  return packed;
}

at::Tensor unpack_bool_saved(const at::Tensor& packed, int64_t n) {
  at::Tensor mask = at::empty({n}, at::TensorOptions().dtype(at::kBool));
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

TORCH_LIBRARY(gactx_cpu, m) {
  const std::vector<at::Tag> flexible = {at::Tag::flexible_layout};  // a saved value in any layout: no copy first
  m.def("quantize_saved(Tensor t, int bits, int group, bool stochastic, int salt, int token, float factor, "
        "float factor_special) -> Tensor", flexible);
  m.def("dequantize_saved(Tensor stored, int bits, int group, int n, ScalarType dtype) -> Tensor");
  m.def("pack_bool_saved(Tensor t, int token) -> Tensor", flexible);
  m.def("unpack_bool_saved(Tensor packed, int n) -> Tensor");
  m.def("keep_saved(Tensor t, int token) -> Tensor", flexible);
}

TORCH_LIBRARY_IMPL(gactx_cpu, CPU, m) {
  m.impl("quantize_saved", &quantize_saved);
  m.impl("dequantize_saved", &dequantize_saved);
  m.impl("pack_bool_saved", &pack_bool_saved);
  m.impl("unpack_bool_saved", &unpack_bool_saved);
  m.impl("keep_saved", &keep_saved);
}

// No autograd kernels: graphs call the ops where nothing is recorded (AOTAutograd's compiled forward and backward),
// and autograd's fallback for an op without one, which checks every input, cost as much as the op at small sizes.
TORCH_LIBRARY_IMPL(gactx_cpu, Autograd, m) {
  for (const char* name : {"quantize_saved", "dequantize_saved", "pack_bool_saved", "unpack_bool_saved", "keep_saved"})
    m.impl(name, torch::CppFunction::makeFallthrough());
}
"""

_FUNCTIONS = [
    "quantize", "dequantize", "normal_quantize", "normal_dequantize", "encode_bins", "decode_table", "pack_bool",
    "pack_compare", "unpack_bool", "drain_log",
]  # fmt: skip
_FLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-march=native", "-fopenmp"]
_lock = threading.Lock()
_state: dict[str, object] = {}


def _name() -> str:
    key = "\n".join([_SOURCE, *_FLAGS, platform.machine(), torch.__version__])
    return "gactx_cpu_" + hashlib.sha1(key.encode()).hexdigest()[:12]


def extension():
    """The compiled extension (built on first call), or ``None`` where it cannot be built (warned once)."""
    if "module" in _state:
        return _state["module"]
    with _lock:
        if "module" not in _state:
            module = _build()
            if module is not None:
                _register_fakes()
            _state["module"] = module
    return _state["module"]


def _register_fakes() -> None:
    """What the ops of compiled graphs (``gactx_cpu::*_saved``, registered by the extension) return, for tracing."""

    def stored(t, nbytes):
        return t.new_empty(nbytes, dtype=torch.uint8)

    def quantize_saved(t, bits, group, stochastic, salt, token, factor, factor_special):
        return stored(t, expected_nbytes(t.numel(), t.dtype, bits, group))  # codes, then each group's (lo, step)

    fakes = {
        "quantize_saved": quantize_saved,
        "dequantize_saved": lambda stored, bits, group, n, dtype: stored.new_empty(n, dtype=dtype),
        "pack_bool_saved": lambda t, token: stored(t, expected_nbytes(t.numel(), torch.bool, 1)),
        "unpack_bool_saved": lambda packed, n: packed.new_empty(n, dtype=torch.bool),
        "keep_saved": lambda t, token: stored(t, 1),
    }
    for name, fake in fakes.items():
        torch.library.register_fake(f"gactx_cpu::{name}")(fake)


def drain_log() -> list[int]:
    """The events the ops of compiled graphs logged since the last call, in order: ``kind`` (0 a save ran, 2 the graph
    released it), ``token``, ``rank``, then ``rank`` sizes (none for a release). Empty where the extension is not
    built."""
    module = _state.get("module")
    return module.drain_log() if module is not None else []


def _build():
    from torch.utils import cpp_extension

    log.info("gactx: compiling the CPU kernels (once for this machine and torch; about 40 s)")
    try:
        return cpp_extension.load_inline(
            _name(), cpp_sources=_SOURCE, functions=_FUNCTIONS,
            extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"], verbose=False,
        )  # fmt: skip
    except Exception as e:  # no compiler, no ninja, a failed build: the torch path, said once
        warnings.warn(
            f"gactx: the C++ CPU kernels could not be built ({type(e).__name__}: {str(e).strip()[:300]}); "
            "falling back to the torch kernels (same results, slower, with temporaries the size of the tensor)",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def available() -> bool:
    return extension() is not None


def quantize(x: torch.Tensor, bits: int, group_size: int, stochastic: bool, seed: int):
    """``(codes, meta)`` of a contiguous CPU tensor (any shape: its elements in order), in the format of
    ``format.py``."""
    return extension().quantize(x, bits, group_size, stochastic, seed, *step_factors(bits))


@functools.cache
def step_factors(bits: int) -> tuple[float, float]:
    """The kernel's step factors at ``bits``: of all ``2**bits - 1`` levels, and of one fewer (special groups)."""
    levels = (1 << bits) - 1
    return step_factor(levels), step_factor(levels - 1)


def dequantize(codes: torch.Tensor, meta: torch.Tensor, bits: int, group_size: int, shape, dtype: torch.dtype):
    """The decoded tensor, contiguous of ``shape`` (a number of elements, or a shape of that many)."""
    out = torch.empty(shape, dtype=dtype)
    extension().dequantize(codes, meta, out, bits, group_size)
    return out


@functools.cache
def _normal_shape(bits: int) -> tuple[list[float], int]:
    """The normal scheme's float32 factors at ``bits`` (``normal.py``'s, in the order of ``NormalShape``) and the
    intervals a tail."""
    f = _normal_factors(bits)
    order = ("k", "share", "tail", "last_tail", "inner_both", "inner_no_lower", "last_with_lower", "last_alone")
    return [f[key] for key in (*order, "last_special")], SHAPES[bits][1]


def normal_quantize(x: torch.Tensor, bits: int, group_size: int, stochastic: bool, seed: int):
    """``(codes, meta)`` of a contiguous CPU tensor in the normal scheme (``normal.py``), meta int32
    ``[n_groups, 3]``: the torch twin's bytes with ``stochastic=False``."""
    return extension().normal_quantize(x, bits, group_size, stochastic, seed, *_normal_shape(bits))


def normal_dequantize(codes: torch.Tensor, meta: torch.Tensor, bits: int, group_size: int, shape, dtype: torch.dtype):
    """The normal scheme's decoded tensor, contiguous of ``shape`` (a number of elements, or a shape of that many):
    the torch twin's bits."""
    out = torch.empty(shape, dtype=dtype)
    extension().normal_dequantize(codes, meta, out, bits, group_size, *_normal_shape(bits))
    return out


def encode_bins(flat: torch.Tensor, edges: torch.Tensor, bits: int) -> torch.Tensor:
    """``torch.bucketize(flat, edges)`` packed ``8 / bits`` codes a byte (the layout of ``codes.py``)."""
    packed = torch.empty(-(-flat.numel() * bits // 8), dtype=torch.uint8)
    extension().encode_bins(flat, edges.contiguous(), packed, bits)
    return packed


def decode_table(packed: torch.Tensor, table: torch.Tensor, shape, bits: int) -> torch.Tensor:
    """``table[codes]`` of the codes packed by :func:`encode_bins`, contiguous of ``shape`` (a number of elements, or
    a shape of that many)."""
    out = torch.empty(shape, dtype=table.dtype)
    extension().decode_table(packed, table.contiguous(), out, bits)
    return out


def pack_bool(flat: torch.Tensor) -> torch.Tensor:
    """A contiguous bool tensor packed 8 to a byte, element ``8k + i`` in bit ``i`` of byte ``k`` (the layout of
    ``bitmask.py``)."""
    packed = torch.empty(-(-flat.numel() // 8), dtype=torch.uint8)
    extension().pack_bool(flat, packed)
    return packed


# The tests of :func:`pack_compare`, by name: ``(kind, lo, hi)`` -> the kernel's KIND.
COMPARE_KINDS = {"gt": 0, "open": 1, "outside": 2, "closed": 3, "ge": 4, "le": 5}


def pack_compare(x: torch.Tensor, kind: str, lo: float, hi: float) -> torch.Tensor:
    """A contiguous float tensor's test against its bounds (``COMPARE_KINDS``: ``gt`` is ``x > lo``,
    ``open`` ``lo < x < hi``, ``outside`` not ``lo <= x <= hi``, ``closed`` ``lo <= x <= hi``, ``ge``
    and ``le`` one bound), packed as :func:`pack_bool` packs the bool result, without the bool tensor. The bounds
    are compared in float32: a float16 or bfloat16 tensor's must be exact in its dtype."""
    return extension().pack_compare(x, COMPARE_KINDS[kind], lo, hi)


def unpack_bool(packed: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.empty(n, dtype=torch.bool)
    extension().unpack_bool(packed, out)
    return out
