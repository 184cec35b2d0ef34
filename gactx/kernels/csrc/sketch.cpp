// The row sketch's choice of rows (schemes/sketch.py's kept_rows): a hash of (seed, row) a row, then the rows of the
// smallest keys, in increasing order. The same hash as the torch form's, so the same rows.
#include "common.h"
#include "kernels.h"

namespace gactx {

at::Tensor kept_rows(int64_t n_rows, int64_t n_kept, int64_t seed, bool complement) {
  TORCH_CHECK(n_rows >= 0 && n_kept >= 0 && n_kept <= n_rows && seed >= 0);
  const uint32_t k0 = uint32_t(uint64_t(seed) & 0xFFFFFFFFu), k1 = uint32_t(uint64_t(seed) >> 32);
  int index_bits = 1;
  while (index_bits < 63 && (int64_t(1) << index_bits) < n_rows) ++index_bits;  // bit_length(n_rows - 1), at least 1
  std::vector<std::pair<int64_t, int64_t>> keys(static_cast<size_t>(n_rows));
  for (int64_t r = 0; r < n_rows; ++r) {
    const uint32_t h = fmix(uint32_t(uint64_t(r)) * 0x9E3779B9u ^ k0 ^ kHashOffset);
    const uint32_t hi = fmix(h ^ k1 ^ uint32_t(uint64_t(r) >> 32) * 0x85EBCA77u);
    const uint32_t lo = fmix(hi ^ 0x2545F491u);
    const int64_t key = (int64_t(hi) << 31) | int64_t(lo >> 1);  // 63 random bits, non-negative
    keys[size_t(r)] = {((key >> index_bits) << index_bits) | r, r};  // distinct: ties go to lower rows
  }
  // The kept rows are those of the n_kept smallest keys; the complement, the others (every row where those are none).
  const int64_t count = complement ? (n_kept < n_rows ? n_rows - n_kept : n_rows) : n_kept;
  const bool all = complement && n_kept >= n_rows;
  if (!all) {
    std::nth_element(keys.begin(), keys.begin() + n_kept, keys.end());
  }
  at::Tensor out = at::empty({count}, at::TensorOptions().dtype(at::kLong));
  int64_t* rows = out.data_ptr<int64_t>();
  const auto first = all ? keys.begin() : (complement ? keys.begin() + n_kept : keys.begin());
  for (int64_t i = 0; i < count; ++i) rows[i] = first[i].second;
  std::sort(rows, rows + count);
  return out;
}

}  // namespace gactx
