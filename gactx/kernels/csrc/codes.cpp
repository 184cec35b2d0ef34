// Table codes: FewBit's bins of a derivative's value (encode_bins, torch.bucketize's counts) and their decoding
// through a table (codes.py, fewbit.py).
#include "common.h"
#include "kernels.h"

#include <memory>
#include <mutex>
#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace gactx {
namespace {

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

#if defined(__AVX2__)
// Eight values as float32 (exactly: bfloat16 and float16 widen without rounding).
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const c10::BFloat16* x) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#if defined(__F16C__)
inline __m256 load8(const c10::Half* x) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
}
#endif

// A value's cell, eight at a time: ((v - first) * inv) clamped to [0, top], as the scalar loops compute it (no fused
// multiply-add). max(f, 0) returns its second operand where f is NaN: 0, as std::max(0, NaN) does.
struct Cells8 {
  __m256 first, inv, top;
  Cells8(float f, float i, float t) : first(_mm256_set1_ps(f)), inv(_mm256_set1_ps(i)), top(_mm256_set1_ps(t)) {}
  __m256i operator()(__m256 v) const {
    const __m256 f = _mm256_max_ps(_mm256_mul_ps(_mm256_sub_ps(v, first), inv), _mm256_setzero_ps());
    return _mm256_cvttps_epi32(_mm256_min_ps(top, f));
  }
};

// Eight codes stored as bytes, NaN's (``count``) where v is NaN.
inline void store8(uint8_t* packed, __m256i code, __m256 v, __m256i count) {
  code = _mm256_blendv_epi8(code, count, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  const __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(code, code), _mm256_setzero_si256());
  const uint32_t lo = uint32_t(_mm256_extract_epi32(bytes, 0)), hi = uint32_t(_mm256_extract_epi32(bytes, 4));
  std::memcpy(packed, &lo, 4);
  std::memcpy(packed + 4, &hi, 4);
}

// bins_by_cell's loop, eight values at a time: each cell's count and edge gathered from the table. Returns the values
// done (a multiple of 8).
template <typename T>
int64_t bins_by_cell_avx2(const T* x, int64_t n, const BinCell* cells, int32_t count, float first, float inv,
                          float top, uint8_t* packed) {
  const Cells8 cell(first, inv, top);
  const __m256i one = _mm256_set1_epi32(1), nan_code = _mm256_set1_epi32(count);
  const int* below = reinterpret_cast<const int*>(cells);
  const float* edge = reinterpret_cast<const float*>(cells) + 1;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = load8(x + i);
    const __m256i c = cell(v);
    const __m256i b = _mm256_i32gather_epi32(below, c, sizeof(BinCell));
    const __m256 e = _mm256_i32gather_ps(edge, c, sizeof(BinCell));
    // below + !(edge >= v): the comparison's true lanes are -1
    const __m256i ge = _mm256_castps_si256(_mm256_cmp_ps(e, v, _CMP_GE_OQ));
    store8(packed + i, _mm256_add_epi32(b, _mm256_add_epi32(one, ge)), v, nan_code);
  }
  return i;
}
#endif

template <typename T>
void bins_by_cell(const T* x, int64_t n, const BinCell* cells, int64_t count, float first, float inv, float top,
                  uint8_t* packed) {
  // By value: a uint8_t store may alias anything, so values captured by reference would be read again each element
  at::parallel_for(0, n, grain(int64_t(sizeof(T))), [=](int64_t i0, int64_t i1) {
#if defined(__AVX2__) && defined(__F16C__)
    i0 += bins_by_cell_avx2(x + i0, i1 - i0, cells, int32_t(count), first, inv, top, packed + i0);
#elif defined(__AVX2__)
    if constexpr (!std::is_same_v<T, c10::Half>) {
      i0 += bins_by_cell_avx2(x + i0, i1 - i0, cells, int32_t(count), first, inv, top, packed + i0);
    }
#endif
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
  // No gathers here: a gather a step costs what the scalar search does (tanh's 8-bit table: 3.2 ns a value both ways)
  at::parallel_for(0, n, grain(int64_t(sizeof(T))), [=](int64_t i0, int64_t i1) {  // by value, as above
    for (int64_t i = i0; i < i1; ++i) {
      const float v = to_float(x[i]);
      int32_t code = lut[int32_t(std::min(top, std::max(0.0f, (v - first) * inv)))];
      for (int32_t step = 1 << (STEPS - 1); step > 0; step >>= 1) code += !(e[code + step - 1] >= v) ? step : 0;
      packed[i] = uint8_t(v == v ? code : int32_t(count));
    }
  });
}

// The index of one table of edges, built once (up to 2 * 2**16 cells: a build took about 7 us, longer than the codes
// of a 64 x 64 tensor) and kept for the next call with the same edges (a FewBit table is met at every save).
struct BinIndex {
  std::vector<float> edges;  // the key: the edges as given
  float first = 0.0f, inv = 0.0f, top = 0.0f;
  std::vector<BinCell> cells;  // cells of one edge at most (window <= 1), else empty
  std::vector<int32_t> lut;  // else the edges in lower cells, searched in `padded` over 2**steps edges
  std::vector<float> padded;
  int steps = 0;
};

std::shared_ptr<const BinIndex> build_index(const std::vector<float>& edges) {
  constexpr int64_t kCells = 1 << 16;
  auto index = std::make_shared<BinIndex>();
  index->edges = edges;
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
  index->first = first;
  index->inv = inv;
  index->top = float(cells);
  if (window <= 1) {
    index->cells.assign(cells + 1, BinCell{0, INFINITY});
    int32_t below = 0;
    for (int64_t c = 0, j = 0; c <= cells; ++c) {
      index->cells[c].below = below;
      if (in_cell[c]) index->cells[c].edge = edges[j++];
      below += int32_t(in_cell[c]);
    }
    return index;
  }
  index->lut.resize(cells + 1);
  int32_t below = 0;
  for (int64_t c = 0; c <= cells; ++c) {
    index->lut[c] = below;
    below += int32_t(in_cell[c]);
  }
  while ((int64_t(1) << index->steps) <= window) ++index->steps;  // the search covers [lut, lut + 2**steps - 1]
  index->padded = edges;
  index->padded.resize(count + (int64_t(1) << index->steps), INFINITY);  // the search may look past the last edge
  return index;
}

// The index of `edges`: the one kept for the same edges (bit for bit), or a new one, kept (the last 16 tables).
std::shared_ptr<const BinIndex> bin_index(const std::vector<float>& edges) {
  static std::mutex lock;
  static std::vector<std::shared_ptr<const BinIndex>> kept;
  const size_t bytes = edges.size() * sizeof(float);
  {
    std::lock_guard<std::mutex> guard(lock);
    for (const auto& index : kept) {
      if (index->edges.size() == edges.size() && std::memcmp(index->edges.data(), edges.data(), bytes) == 0) {
        return index;
      }
    }
  }
  auto index = build_index(edges);  // outside the lock: another thread may build the same one, and keep it too
  std::lock_guard<std::mutex> guard(lock);
  if (kept.size() >= 16) kept.erase(kept.begin());
  kept.push_back(index);
  return index;
}

template <typename T>
void encode_bins_lut(const T* x, int64_t n, const std::vector<float>& edges, uint8_t* packed) {
  const auto index = bin_index(edges);
  const BinIndex& i = *index;
  const int64_t count = int64_t(edges.size());
  if (!i.cells.empty()) {
    bins_by_cell<T>(x, n, i.cells.data(), count, i.first, i.inv, i.top, packed);
    return;
  }
  const float* e = i.padded.data();
  const int32_t* lut = i.lut.data();
  switch (i.steps) {  // the search unrolled: a constant number of steps
    case 2: return bins_searched<T, 2>(x, n, e, lut, count, i.first, i.inv, i.top, packed);
    case 3: return bins_searched<T, 3>(x, n, e, lut, count, i.first, i.inv, i.top, packed);
    case 4: return bins_searched<T, 4>(x, n, e, lut, count, i.first, i.inv, i.top, packed);
    case 5: return bins_searched<T, 5>(x, n, e, lut, count, i.first, i.inv, i.top, packed);
    case 6: return bins_searched<T, 6>(x, n, e, lut, count, i.first, i.inv, i.top, packed);
    case 7: return bins_searched<T, 7>(x, n, e, lut, count, i.first, i.inv, i.top, packed);
    default: return bins_searched<T, 8>(x, n, e, lut, count, i.first, i.inv, i.top, packed);
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

}  // namespace

at::Tensor encode_bins(at::Tensor x, at::Tensor edges, int64_t bits) {
  TORCH_CHECK(x.is_contiguous());
  TORCH_CHECK(edges.scalar_type() == x.scalar_type());
  edges = edges.contiguous();
  at::Tensor packed = cpu_empty({(x.numel() * bits + 7) / 8}, at::kByte);
  GACTX_DISPATCH(x.scalar_type(), encode_bins_impl<scalar>(x.data_ptr<scalar>(), x.numel(),
                 edges.data_ptr<scalar>(), edges.numel(), packed.data_ptr<uint8_t>(), int(bits)));
  return packed;
}


at::Tensor decode_table(at::Tensor packed, at::Tensor table, at::IntArrayRef shape, int64_t bits) {
  TORCH_CHECK(packed.is_contiguous());
  table = table.contiguous();
  at::Tensor out = cpu_empty(shape, table.scalar_type());
  advise_huge_pages(out.data_ptr(), out.nbytes());
  GACTX_DISPATCH(out.scalar_type(), decode_table_impl<scalar>(packed.data_ptr<uint8_t>(), table.data_ptr<scalar>(),
                 out.data_ptr<scalar>(), out.numel(), int(bits)));
  return out;
}

}  // namespace gactx
