// Masks 8 to a byte: a bool tensor packed, an op's own comparison packed with no bool tensor between, and back
// (bitmask.py).
#include <array>

#include "common.h"
#include "kernels.h"

namespace gactx {
namespace {

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

// Each packed byte's 8 bools as one 8-byte word (element k in byte k: little-endian, as pack8 reads them).
const std::array<uint64_t, 256>& spread_table() {
  static const std::array<uint64_t, 256> table = [] {
    std::array<uint64_t, 256> t{};
    for (int byte = 0; byte < 256; ++byte)
      for (int k = 0; k < 8; ++k) t[byte] |= uint64_t((byte >> k) & 1) << (8 * k);
    return t;
  }();
  return table;
}

void unpack_bool_impl(const uint8_t* __restrict packed, int64_t n, uint8_t* __restrict mask) {
  static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "a word's byte k is element k");
  const uint64_t* spread = spread_table().data();
  const int64_t whole = n / 8;  // packed bytes all of whose bits are elements
  // By value: a uint8_t store may alias anything, so pointers captured by reference would be read again each byte
  at::parallel_for(0, whole, kGrainBytes / 8, [=](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) std::memcpy(mask + 8 * b, spread + packed[b], 8);
  });
  for (int64_t i = whole * 8; i < n; ++i) mask[i] = (packed[i >> 3] >> (i & 7)) & 1;
}

}  // namespace

void pack_bool(at::Tensor mask, at::Tensor packed) {
  TORCH_CHECK(mask.is_contiguous() && packed.is_contiguous() && mask.scalar_type() == at::kBool);
  pack_bool_impl(reinterpret_cast<const uint8_t*>(mask.data_ptr<bool>()), mask.numel(), packed.data_ptr<uint8_t>());
}

at::Tensor pack_compare(at::Tensor x, int64_t kind, double lo, double hi) {
  TORCH_CHECK(x.is_contiguous() && x.device().is_cpu() && kind >= 0 && kind <= 5);
  at::Tensor packed = cpu_empty({(x.numel() + 7) / 8}, at::kByte);
  GACTX_DISPATCH(x.scalar_type(), pack_compare_impl<scalar>(x.data_ptr<scalar>(), x.numel(),
                 packed.data_ptr<uint8_t>(), int(kind), float(lo), float(hi)));
  return packed;
}

void unpack_bool(at::Tensor packed, at::Tensor mask) {
  TORCH_CHECK(mask.is_contiguous() && packed.is_contiguous() && mask.scalar_type() == at::kBool);
  advise_huge_pages(mask.data_ptr(), mask.nbytes());
  unpack_bool_impl(packed.data_ptr<uint8_t>(), mask.numel(), reinterpret_cast<uint8_t*>(mask.data_ptr<bool>()));
}

}  // namespace gactx
