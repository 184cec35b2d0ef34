// A replayed save's handle (saved.h). Its checks are store.Packed's, in the same order: the saved tensor's version
// counter (saved-tensor hooks skip autograd's own check), then the saved tensor read where it still lives unchanged
// (its owner alive at the same version, dtype and storage), else the stored codes decoded.
#include "saved.h"

#include "common.h"
#include "kernels.h"

#include <ATen/ops/as_strided.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>

namespace gactx {

std::atomic<int64_t> Saved::alive{0};

Saved::Saved() { alive.fetch_add(1, std::memory_order_relaxed); }
Saved::~Saved() { alive.fetch_sub(1, std::memory_order_relaxed); }

namespace {

inline int64_t version_of(const c10::TensorImpl& impl) { return impl.version_counter().current_version(); }

// An int64 parameter, or an int32 one (Launches::wide): its slot holds the value either way.
struct Size {
  int64_t wide;
  int32_t narrow;
  Size(int64_t v) : wide(v), narrow(static_cast<int32_t>(v)) {}
  void* at(bool is_wide) { return is_wide ? static_cast<void*>(&wide) : static_cast<void*>(&narrow); }
};

}  // namespace

void launch_encode(const Launches& l, const at::Tensor& x, void* buffer, int64_t seed) {
  const c10::DeviceGuard guard(l.device);  // the device whose context loaded the kernels
  void* in = const_cast<void*>(x.const_data_ptr());
  void* codes = buffer;
  void* second = static_cast<uint8_t*>(codes) + l.aux_offset;
  void* edges = l.seeded ? nullptr : l.edges.data_ptr();
  Size n(l.n), full(l.encode_full);
  int64_t seed_value = seed;
  void* stream = current_stream(l.device);
  if (l.seeded && l.advance.function != 0 && stream_capturing(stream)) {  // replayed by CUDA graphs: a device seed
    void* on_device = l.seed.data_ptr();
    void* advance[] = {&on_device};
    launch_kernel(l.advance, 1, stream, advance, 1);
    void* params[] = {&in, &codes, &second, n.at(l.wide), &on_device, full.at(false)};
    launch_kernel(l.encode_from_memory, l.encode_grid, stream, params, 6);
  } else if (l.seeded) {
    void* params[] = {&in, &codes, &second, n.at(l.wide), &seed_value, full.at(false)};
    launch_kernel(l.encode, l.encode_grid, stream, params, 6);
  } else {
    void* params[] = {&in, &edges, &codes, n.at(l.wide), full.at(false)};
    launch_kernel(l.encode, l.encode_grid, stream, params, 5);
  }
}

void launch_decode(const Launches& l, const void* buffer, at::Tensor& out) {
  const c10::DeviceGuard guard(l.device);
  void* codes = const_cast<void*>(buffer);
  void* second = l.seeded ? static_cast<void*>(static_cast<uint8_t*>(codes) + l.aux_offset) : l.table.data_ptr();
  void* target = out.data_ptr();
  Size n(l.n), full(l.decode_full);
  void* params[] = {&codes, &second, &target, n.at(l.wide), full.at(false)};
  launch_kernel(l.decode, l.decode_grid, current_stream(l.device), params, 5);
}

// The decoded tensor, contiguous of ``sizes``, written by the decoding's launch.
at::Tensor launched_decode(const Launches& l, const at::Tensor& buffer, const std::vector<int64_t>& sizes) {
  at::Tensor out = at::empty(sizes, buffer.options().dtype(l.dtype));
  launch_decode(l, buffer.const_data_ptr(), out);
  return out;
}

namespace {

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
  if (launches) return launched_decode(*launches, data, sizes);
  if (group > 0) return dequantize(data, meta, sizes, dtype, bits, group);
  return decode_table(data, meta, sizes, bits);
}

int64_t Saved::nbytes() const { return int64_t(data.nbytes() + (meta.defined() ? meta.nbytes() : 0)); }

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

Packer Packer::launched(int64_t bits, int64_t group, Launches launches) {
  TORCH_CHECK(bits >= 1 && bits <= 8 && launches.encode.function != 0 && launches.decode.function != 0 &&
              launches.n > 0 && launches.buffer_bytes >= launches.code_bytes);
  TORCH_CHECK(launches.seeded || (launches.edges.defined() && launches.table.defined()));
  Packer p;
  p.bits = bits;
  p.group = group;
  p.launches = std::make_shared<const Launches>(std::move(launches));
  return p;
}

bool Packer::accepts(const at::Tensor& t) const {
  if (!t.is_contiguous()) return false;
  if (!launches) return t.device().is_cpu();
  const Launches& l = *launches;
  return t.device() == l.device && t.scalar_type() == l.dtype && t.numel() == l.n &&
         reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
}

std::unique_ptr<Saved> Packer::pack(const at::Tensor& t, int64_t seed) const {
  if (!accepts(t)) return nullptr;
  auto h = std::make_unique<Saved>();
  if (launches) {
    h->data = at::empty({launches->buffer_bytes}, t.options().dtype(at::kByte));
    launch_encode(*launches, t, h->data.data_ptr(), seed);
    if (!launches->seeded) h->meta = launches->table;  // counted as the C++ bins' handle counts it
    h->launches = launches;
  } else if (group > 0) {
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
