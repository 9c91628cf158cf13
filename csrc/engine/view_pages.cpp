#include "engine/view_pages.h"

#include <algorithm>
#include <atomic>

#include "core/runs.h"

namespace p2p::engine {
namespace {

// Element by element: a few dimensions, where a call of memcmp took a sixth of a pair's parse.
bool same_dims(c10::IntArrayRef a, c10::IntArrayRef b) {
  if (a.size() != b.size()) return false;
  for (size_t d = 0; d < a.size(); ++d)
    if (a[d] != b[d]) return false;
  return true;
}

// A tensor of the storage, dispatch keys, dtype, sizes and strides of page l0, a groupable()
// one: strided, not empty and on l0's device like it. The storage is read unchecked: l0 has
// one, so a tensor without one differs.
bool same_page(const at::TensorImpl& t, const at::TensorImpl& l0) {
  return t.key_set() == l0.key_set() && t.dtype() == l0.dtype() &&
         t.unsafe_storage().unsafeGetStorageImpl() == l0.unsafe_storage().unsafeGetStorageImpl() &&
         same_dims(t.sizes(), l0.sizes()) && same_dims(t.strides(), l0.strides());
}

bool same_page(const RemoteView& a, const RemoteView& b) {
  return a.region == b.region && a.dtype == b.dtype && same_dims(a.shape, b.shape) && same_dims(a.strides, b.strides);
}

// A new TensorImpl on t's storage, as at::native::as_strided_tensorimpl makes it.
at::Tensor direct_view(const at::TensorImpl& t, c10::IntArrayRef sizes, c10::IntArrayRef strides, int64_t offset) {
  at::Tensor out = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(t.storage()), t.key_set(), t.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides, offset);
  return out;
}

bool same_view(const at::Tensor& a, const at::Tensor& b) {
  const at::TensorImpl &x = *a.unsafeGetTensorImpl(), &y = *b.unsafeGetTensorImpl();
  return x.key_set() == y.key_set() && x.dtype() == y.dtype() && x.device() == y.device() &&
         x.unsafe_storage().unsafeGetStorageImpl() == y.unsafe_storage().unsafeGetStorageImpl() &&
         same_dims(x.sizes(), y.sizes()) && same_dims(x.strides(), y.strides()) &&
         x.storage_offset() == y.storage_offset() && a.data_ptr() == b.data_ptr() &&
         x.is_contiguous() == y.is_contiguous() && a.requires_grad() == b.requires_grad();
}

bool groupable(const at::TensorImpl& t) {
  return t.layout() == at::kStrided && (t.is_cpu() || t.is_cuda()) && t.has_storage() && !t.is_python_dispatch() &&
         t.numel() > 0;
}

std::atomic<int> direct = -1;  // -1: not decided yet

}  // namespace

bool direct_views() {
  if (direct.load(std::memory_order_relaxed) < 0) {
    const at::Tensor probe = at::arange(48, at::kLong).view({8, 6});
    const std::vector<int64_t> sizes{3, 2, 6}, strides{12, 6, 1};
    const bool same = same_view(direct_view(*probe.unsafeGetTensorImpl(), sizes, strides, 6),
                                at::as_strided(probe, sizes, strides, 6));
    int undecided = -1;
    direct.compare_exchange_strong(undecided, same ? 1 : 0);
  }
  return direct.load(std::memory_order_relaxed) == 1;
}

void disable_direct_views() { direct.store(0); }

size_t page_run(const ViewPair* pairs, size_t n, size_t first, std::vector<int64_t>& loffsets,
                std::vector<int64_t>& roffsets) {
  if (!pairs[first].local || !pairs[first].remote) return first + 1;
  const at::TensorImpl& l0 = *pairs[first].local->unsafeGetTensorImpl();
  const RemoteView& r0 = *pairs[first].remote;
  if (!groupable(l0)) return first + 1;
  loffsets.assign(1, l0.storage_offset());
  roffsets.assign(1, r0.offset);
  size_t j = first + 1;
  for (; j < n; ++j) {
    const ViewPair& p = pairs[j];
    if (!p.local || !p.remote) break;
    const at::TensorImpl& l = *p.local->unsafeGetTensorImpl();
    if (!same_page(l, l0) || !same_page(*p.remote, r0)) break;
    loffsets.push_back(l.storage_offset());
    roffsets.push_back(p.remote->offset);
  }
  return j;
}

PagedPair paged_pair(const at::Tensor& l0, const RemoteView& r0, const int64_t* loffsets,
                     const int64_t* roffsets, size_t n) {
  PagedPair p;
  const int64_t count = static_cast<int64_t>(n);
  p.lids = at::empty({count}, at::kLong);
  p.rids = at::empty({count}, at::kLong);
  const core::PageGrid lg = core::page_grid(loffsets, n, p.lids.data_ptr<int64_t>());
  const core::PageGrid rg = core::page_grid(roffsets, n, p.rids.data_ptr<int64_t>());
  Dims sizes{lg.count}, strides{lg.stride};
  sizes.append(l0.sizes().begin(), l0.sizes().end());
  strides.append(l0.strides().begin(), l0.strides().end());
  p.local = direct_views() ? direct_view(*l0.unsafeGetTensorImpl(), sizes, strides, lg.origin)
                           : at::as_strided(l0, sizes, strides, lg.origin);
  auto rv = std::make_shared<RemoteView>();
  rv->region = r0.region;
  rv->dtype = r0.dtype;
  rv->offset = rg.origin;
  rv->shape.reserve(r0.shape.size() + 1);
  rv->strides.reserve(r0.shape.size() + 1);
  rv->shape.push_back(rg.count);
  rv->strides.push_back(rg.stride);
  rv->shape.append(r0.shape.begin(), r0.shape.end());
  rv->strides.append(r0.strides.begin(), r0.strides.end());
  rv->validate();  // inside the region, as each page is
  p.remote = std::move(rv);
  return p;
}

void page_views(const PagedPair& p, std::vector<at::Tensor>& local, std::vector<std::shared_ptr<RemoteView>>& remote) {
  const int64_t n = p.lids.numel();
  const int64_t* lids = p.lids.data_ptr<int64_t>();
  const int64_t* rids = p.rids.data_ptr<int64_t>();
  const RemoteView& r = *p.remote;
  const c10::IntArrayRef rshape(r.shape.data() + 1, r.shape.size() - 1);
  const c10::IntArrayRef rstrides(r.strides.data() + 1, r.strides.size() - 1);
  for (int64_t k = 0; k < n; ++k) {
    local.push_back(p.local.select(0, lids[k]));
    remote.push_back(r.view(r.offset + rids[k] * r.strides[0], rshape, rstrides));
  }
}

}  // namespace p2p::engine
