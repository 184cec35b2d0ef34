// A replayed save's handle (saved.h). Its checks are store.Packed's, in the same order: the saved tensor's version
// counter (saved-tensor hooks skip autograd's own check), then the saved tensor read where it still lives unchanged
// (its owner alive at the same version, dtype and storage), else the stored codes decoded.
#include "saved.h"

#include "common.h"
#include "kernels.h"

#include <ATen/ops/as_strided.h>

namespace gactx {

std::atomic<int64_t> Saved::alive{0};

Saved::Saved() { alive.fetch_add(1, std::memory_order_relaxed); }
Saved::~Saved() { alive.fetch_sub(1, std::memory_order_relaxed); }

namespace {

inline int64_t version_of(const c10::TensorImpl& impl) { return impl.version_counter().current_version(); }

// The tensor a weak pointer names, undefined where it was freed.
inline at::Tensor lock(const WeakImpl& weak) {
  auto strong = weak.lock();
  return strong ? at::Tensor(std::move(strong)) : at::Tensor();
}

}  // namespace

at::Tensor Saved::unpack(at::Tensor& changed, int64_t& expected) const {
  const at::Tensor s = lock(saved), o = lock(owner);
  if (s.defined()) {
    if (version_of(*s.unsafeGetTensorImpl()) != version) {
      changed = s;
      expected = version;
      return at::Tensor();
    }
  } else if (through_base && o.defined() && version_of(*o.unsafeGetTensorImpl()) != owner_version) {
    changed = o;  // the saved view is gone: its base's counter was its own
    expected = owner_version;
    return at::Tensor();
  }
  if (o.defined() && version_of(*o.unsafeGetTensorImpl()) == owner_version && o.scalar_type() == dtype &&
      o.storage().data() == storage) {
    return o.detach().as_strided(sizes, strides, offset);  // alive and unchanged: its own values
  }
  if (group > 0) return dequantize(data, meta, sizes, dtype, bits, group);
  return decode_table(data, meta, sizes, bits);
}

int64_t Saved::nbytes() const { return int64_t(data.nbytes() + meta.nbytes()); }

Packer Packer::quantized(int64_t bits, int64_t group, bool stochastic, double factor, double factor_special) {
  TORCH_CHECK(bits >= 1 && bits <= 8 && group >= 1 && group <= kMaxGroup);
  Packer p;
  p.bits = bits;
  p.group = group;
  p.stochastic = stochastic;
  p.factor = factor;
  p.factor_special = factor_special;
  return p;
}

Packer Packer::bins(at::Tensor edges, int64_t bits, at::Tensor table) {
  TORCH_CHECK(bits >= 2 && bits <= 8 && table.numel() == (int64_t(1) << bits));
  Packer p;
  p.bits = bits;
  p.edges = edges.contiguous();
  p.table = table.contiguous();
  return p;
}

std::unique_ptr<Saved> Packer::pack(const at::Tensor& t, int64_t seed) const {
  if (!t.is_contiguous() || !t.device().is_cpu()) return nullptr;
  auto h = std::make_unique<Saved>();
  if (group > 0) {
    std::tie(h->data, h->meta) = quantize(t, bits, group, stochastic, seed, factor, factor_special);
  } else {
    h->data = encode_bins(t, edges, bits);
    h->meta = table;
  }
  h->bits = bits;
  h->group = group;
  h->dtype = t.scalar_type();
  h->sizes = t.sizes().vec();
  h->strides = t.strides().vec();
  h->offset = t.storage_offset();
  h->saved = WeakImpl(t.getIntrusivePtr());
  const bool view = t.is_view();
  const at::TensorBase& owner = view ? t._base() : static_cast<const at::TensorBase&>(t);
  h->owner = WeakImpl(owner.getIntrusivePtr());
  h->through_base = view;
  h->version = version_of(*t.unsafeGetTensorImpl());
  h->owner_version = version_of(*owner.unsafeGetTensorImpl());
  h->storage = owner.storage().data();
  return h;
}

}  // namespace gactx
