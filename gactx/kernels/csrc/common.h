// What every CPU kernel of gactx shares: float bits, the noise of stochastic rounding, the planes of packed codes,
// huge-page advice, the work a task, and the dispatch over float32, bfloat16 and float16. Built with
// -ffp-contract=off and without fast-math (cpu.py): the same float32 operations as the torch twins, in their order;
// -fno-trapping-math lets loops with selects vectorize (no code reads the floating-point exception flags).
#pragma once

#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#ifdef __linux__
#include <sys/mman.h>
#endif

namespace gactx {

constexpr float kFltMax = 3.4028234663852886e38f;
constexpr float kMinStep = 1.1754943508222875e-38f;  // 2**-126
constexpr int64_t kGrainBytes = 1 << 16;              // work a task at least: about 64 KiB of input
constexpr int64_t kMaxGroup = 4096;                   // format.py's largest group size

// A float64 sum of many terms in kLanes independent lanes (term k in lane k % kLanes), added pairwise at the end: one
// chain of dependent additions costs an addition's latency a term, and the lanes vectorize.
constexpr int kLanes = 8;
template <typename F>
inline double lane_sum(int64_t m, F term) {
  double lanes[kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= m; k += kLanes) {
    for (int j = 0; j < kLanes; ++j) lanes[j] += term(k + j);
  }
  for (; k < m; ++k) lanes[k % kLanes] += term(k);
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

// A contiguous CPU tensor from torch's CPU allocator, as at::empty makes it (torch's memory accounting sees it), without
// its dispatch: the kernels that run for every save allocate their outputs so (64 x 64 at 4 bits, the compiled graphs'
// ops: quantize 4.10 to 3.95 us a call, dequantize 2.17 to 1.93).
inline at::Tensor cpu_empty(at::IntArrayRef sizes, at::ScalarType dtype) { return at::detail::empty_cpu(sizes, dtype); }

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

// The offset the hash's input is taken from: fmix(0) is 0, and without it element 0 of seed 0 would draw u = 0
// on every call (it always rounds down).
constexpr uint32_t kHashOffset = 0x5BD1E995u;

// 1 + u, u uniform on [0, 1) with 23 bits, from (seed, element index i): ``high`` is
// k1 ^ uint32(i >> 32) * 0x85EBCA77, the same for every element of a group (a group never crosses 2**32).
inline float one_plus_u(uint32_t k0, uint32_t high, uint32_t low) {
  const uint32_t h = fmix(fmix(low * 0x9E3779B9u ^ k0 ^ kHashOffset) ^ high);
  return float_of(0x3F800000u | (h >> 9));
}

// A group's codes (one a byte) into its packed bytes: byte k holds code p * W + k in bits p * BITS (the
// planes of format.py). BITS a constant, so that the compiler unrolls the planes and vectorizes over k.
template <int BITS>
inline void pack_planes(const uint8_t* __restrict q, uint8_t* __restrict out, int64_t W) {
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
inline void advise_huge_pages(void* p, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  if (bytes < 4 * int64_t(kHuge)) return;
  const uintptr_t a = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t b = (reinterpret_cast<uintptr_t>(p) + uintptr_t(bytes)) & ~(kHuge - 1);
  if (b > a) madvise(reinterpret_cast<void*>(a), b - a, MADV_HUGEPAGE);
#endif
}

inline int64_t grain(int64_t group_bytes) { return std::max<int64_t>(1, kGrainBytes / std::max<int64_t>(1, group_bytes)); }

// A group's m values as float32 into v, and what both schemes read of them first: the finite values' range, and
// which non-finite values there are. One pass takes the integer min and max of the floats' sortable bits (it
// vectorizes); a second runs only where a value is not finite (rare).
struct GroupRange {
  float fmin, fmax;  // the finite values' range; 0 where there is none
  bool has_nan = false, has_pinf = false, has_ninf = false;
  bool special() const { return has_nan || has_pinf || has_ninf; }
  // What a special group stores as its kind: NaN (bits 0x7FC00000) where NaN or both infinities are in it, else
  // the one infinity.
  float kind() const {
    const float inf = std::numeric_limits<float>::infinity();
    return (has_nan || (has_pinf && has_ninf)) ? std::numeric_limits<float>::quiet_NaN() : (has_pinf ? inf : -inf);
  }
};

template <typename T>
inline GroupRange read_group(const T* xg, int64_t m, float* v) {
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
  GroupRange r;
  if (!nonfinite) {
    r.fmin = float_of(uint32_t(sortable(uint32_t(smin))));
    r.fmax = float_of(uint32_t(sortable(uint32_t(smax))));
    return r;
  }
  r.fmin = std::numeric_limits<float>::infinity();
  r.fmax = -r.fmin;
  for (int64_t k = 0; k < m; ++k) {
    const float f = v[k];
    if (std::isnan(f)) r.has_nan = true;
    else if (std::isinf(f)) (f > 0 ? r.has_pinf : r.has_ninf) = true;
    else { r.fmin = std::min(r.fmin, f); r.fmax = std::max(r.fmax, f); }
  }
  if (!(r.fmin < std::numeric_limits<float>::infinity())) r.fmin = 0.0f;
  if (!(r.fmax > -std::numeric_limits<float>::infinity())) r.fmax = 0.0f;
  return r;
}

// The groups a variance kernel sums: every group of n elements (stride 1, the tail too), or groups 0, stride,
// 2 stride, ... of the whole ones (variance.group_sample's sample, read in place).
inline int64_t sampled_groups(int64_t n, int64_t G, int64_t stride) {
  return stride == 1 ? (n + G - 1) / G : (n / G + stride - 1) / stride;
}

// A variance kernel's per-group sums (float64, ``nw`` a group, group-major): summed over the groups in order, times
// scale, as float32. A loop, not ATen's sum, mul and cast: those three ops cost more than a small tensor's kernel.
inline at::Tensor scaled_sums(const std::vector<double>& partial, int64_t nw, double scale) {
  at::Tensor out = at::empty({nw}, at::TensorOptions().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  const int64_t groups = nw ? int64_t(partial.size()) / nw : 0;
  for (int64_t w = 0; w < nw; ++w) {
    double sum = 0.0;
    for (int64_t g = 0; g < groups; ++g) sum += partial[g * nw + w];
    o[w] = float(sum * scale);
  }
  return out;
}

#define GACTX_DISPATCH(DTYPE, FN, ...)                                                    \
  switch (DTYPE) {                                                                        \
    case at::kFloat: { using scalar = float; FN; break; }                                 \
    case at::kBFloat16: { using scalar = at::BFloat16; FN; break; }                      \
    case at::kHalf: { using scalar = at::Half; FN; break; }                               \
    default: TORCH_CHECK(false, "gactx CPU kernels take float32, bfloat16 or float16, not ", DTYPE); \
  }

}  // namespace gactx
