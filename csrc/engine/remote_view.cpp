#include "engine/remote_view.h"

#include <ATen/TensorUtils.h>

#include <limits>

#include "common/wire.h"
#include "core/runs.h"

namespace p2p::engine {

using namespace core;
namespace {

constexpr uint32_t kTensorMagic = 0x54503250;  // "P2PT"
constexpr uint8_t kVersion = 1;
constexpr size_t kMaxDims = 64;

std::string dims(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += cat(i ? ", " : "", v[i]);
  return s + "]";
}

}  // namespace

void RemoteView::validate() const {
  P2P_CHECK(region, ErrorKind::Value, "RemoteTensor without a region");
  P2P_CHECK(shape.size() == strides.size() && shape.size() <= kMaxDims, ErrorKind::Value,
            "RemoteTensor: shape and strides disagree or have too many dimensions");
  P2P_CHECK(offset >= 0, ErrorKind::Value, "RemoteTensor: negative offset");
  // 128-bit arithmetic: sizes and strides come from other processes and may be huge.
  using u128 = unsigned __int128;
  const u128 limit = region->nbytes;
  u128 last = 0;
  bool empty = false;
  for (size_t i = 0; i < shape.size(); ++i) {
    P2P_CHECK(shape[i] >= 0 && strides[i] >= 0, ErrorKind::Value, "RemoteTensor: negative size or stride");
    if (shape[i] == 0) empty = true;
    else last += static_cast<u128>(shape[i] - 1) * static_cast<u128>(strides[i]);
    P2P_CHECK(last <= limit, ErrorKind::Value, "RemoteTensor: view extends beyond the region");
  }
  const u128 end = (static_cast<u128>(offset) + (empty ? 0 : last + 1)) * static_cast<u128>(elem());
  P2P_CHECK(end <= limit, ErrorKind::Value, "RemoteTensor: view extends beyond its region's ",
            region->nbytes, " bytes");
}

std::shared_ptr<RemoteView> RemoteView::view(int64_t new_offset, c10::IntArrayRef new_shape,
                                             c10::IntArrayRef new_strides) const {
  auto v = std::make_shared<RemoteView>();
  v->region = region;
  v->dtype = dtype;
  v->offset = new_offset;
  v->shape.assign(new_shape.begin(), new_shape.end());
  v->strides.assign(new_strides.begin(), new_strides.end());
  v->validate();
  return v;
}

std::shared_ptr<RemoteView> RemoteView::index(const IndexItem* items, size_t n) const {
  using Kind = IndexItem::Kind;
  const size_t ndim = shape.size();
  size_t specified = 0, ellipses = 0;
  for (size_t k = 0; k < n; ++k) {
    specified += items[k].kind == Kind::Slice || items[k].kind == Kind::Int;
    ellipses += items[k].kind == Kind::Ellipsis;
  }
  P2P_CHECK(specified <= ndim, ErrorKind::Index, "too many indices for a RemoteTensor of dimension ", ndim);
  P2P_CHECK(ellipses <= 1, ErrorKind::Index, "an index can only have a single ellipsis ('...')");
  auto v = std::make_shared<RemoteView>();
  v->region = region;
  v->dtype = dtype;
  v->shape.reserve(ndim + n - specified);
  v->strides.reserve(ndim + n - specified);
  // Python's integers have no overflow: 128 bits hold what torch's offset would be, and an
  // offset past int64 is refused below (it could only belong to an empty view).
  __int128 at = offset;
  size_t dim = 0;
  for (size_t k = 0; k < n; ++k) {
    const IndexItem& item = items[k];
    switch (item.kind) {
      case Kind::NewAxis:
        v->shape.push_back(1);
        v->strides.push_back(1);
        break;
      case Kind::Ellipsis:
        for (size_t skip = ndim - specified; skip > 0; --skip, ++dim) {
          v->shape.push_back(shape[dim]);
          v->strides.push_back(strides[dim]);
        }
        break;
      case Kind::Slice: {
        P2P_CHECK(item.step > 0, ErrorKind::Value, "RemoteTensor slices need a positive step");
        // slice.indices(size) for a positive step.
        const int64_t size = shape[dim];
        auto clamp = [&](int64_t i) { return i < 0 ? std::max<int64_t>(i + size, 0) : std::min(i, size); };
        const int64_t start = clamp(item.start), stop = clamp(item.stop);
        const int64_t count = stop > start ? (stop - start - 1) / item.step + 1 : 0;
        at += static_cast<__int128>(start) * strides[dim];  // also for an empty slice, as torch does
        int64_t stride;
        if (__builtin_mul_overflow(strides[dim], item.step, &stride)) {
          P2P_CHECK(count <= 1, ErrorKind::Value, "slice step ", item.step, " makes the stride of dimension ",
                    dim, " overflow");
          stride = strides[dim];  // one element or none: the stride is never used
        }
        v->shape.push_back(count);
        v->strides.push_back(stride);
        ++dim;
        break;
      }
      case Kind::Int: {
        const int64_t size = shape[dim], i = item.start;
        P2P_CHECK(-size <= i && i < size, ErrorKind::Index, "index ", i, " is out of bounds for dimension ", dim,
                  " with size ", size);
        at += static_cast<__int128>(i < 0 ? i + size : i) * strides[dim];
        ++dim;
        break;
      }
    }
  }
  for (; dim < ndim; ++dim) {
    v->shape.push_back(shape[dim]);
    v->strides.push_back(strides[dim]);
  }
  P2P_CHECK(at <= std::numeric_limits<int64_t>::max(), ErrorKind::Value, "RemoteTensor: the view's offset overflows");
  v->offset = static_cast<int64_t>(at);
  v->validate();
  return v;
}

std::shared_ptr<RemoteView> RemoteView::reshaped(std::vector<int64_t> new_shape) const {
  __int128 numel = 1;
  for (int64_t s : shape) numel = s == 0 ? 0 : std::min<__int128>(numel * s, __int128{1} << 64);
  __int128 known = 1;
  size_t infer = new_shape.size();
  for (size_t d = 0; d < new_shape.size(); ++d) {
    if (new_shape[d] == -1) {
      P2P_CHECK(infer == new_shape.size(), ErrorKind::Value, "only one dimension can be inferred");
      infer = d;
      continue;
    }
    P2P_CHECK(new_shape[d] >= 0, ErrorKind::Value, "invalid shape dimension ", new_shape[d]);
    known = new_shape[d] == 0 ? 0 : std::min<__int128>(known * new_shape[d], __int128{1} << 64);
  }
  if (infer < new_shape.size()) {
    P2P_CHECK(known != 0 && numel % known == 0, ErrorKind::Value, "shape ", dims(new_shape),
              " is invalid for a RemoteTensor of ", static_cast<uint64_t>(numel), " elements");
    new_shape[infer] = static_cast<int64_t>(numel / known);
    known = numel;
  }
  P2P_CHECK(known == numel, ErrorKind::Value, "shape ", dims(new_shape),
            " is invalid for a RemoteTensor of ", static_cast<uint64_t>(numel), " elements");
  std::optional<std::vector<int64_t>> new_strides = at::detail::computeStride(shape, strides, new_shape);
  P2P_CHECK(new_strides, ErrorKind::Value, "view size is not compatible with the RemoteTensor's size and stride "
            "(at least one dimension spans across two contiguous subspaces)");
  return view(offset, new_shape, *new_strides);
}

std::string RemoteView::encode() const {
  std::string region_bytes;
  region->encode(region_bytes);
  ByteWriter w;
  w.put(kTensorMagic);
  w.put(kVersion);
  w.put_bytes(region_bytes);
  w.put(static_cast<int8_t>(dtype));
  w.put(static_cast<uint8_t>(shape.size()));
  for (int64_t s : shape) w.put(s);
  for (int64_t s : strides) w.put(s);
  w.put(offset);
  w.seal();
  return std::move(w.str());
}

std::shared_ptr<RemoteView> RemoteView::decode(std::string_view bytes) {
  ByteReader r(bytes, "RemoteTensor bytes");
  r.check_crc();
  if (r.get<uint32_t>() != kTensorMagic) r.fail("not a torch_p2p RemoteTensor");
  if (r.get<uint8_t>() != kVersion) r.fail("unsupported version");
  auto v = std::make_shared<RemoteView>();
  v->region = RemoteRegion::decode(r.get_bytes(1 << 24));
  const int8_t code = r.get<int8_t>();
  if (code < 0 || code >= static_cast<int8_t>(c10::ScalarType::NumOptions) ||
      code == static_cast<int8_t>(c10::ScalarType::Undefined))
    r.fail("unknown dtype");
  v->dtype = static_cast<c10::ScalarType>(code);
  try {
    if (c10::elementSize(v->dtype) == 0) r.fail("dtype without a size");
  } catch (const c10::Error&) {
    r.fail("dtype without a size");
  }
  const uint8_t ndim = r.get<uint8_t>();
  if (ndim > kMaxDims) r.fail("too many dimensions");
  v->shape.resize(ndim);
  v->strides.resize(ndim);
  for (auto& s : v->shape) s = r.get<int64_t>();
  for (auto& s : v->strides) s = r.get<int64_t>();
  v->offset = r.get<int64_t>();
  r.expect_end();
  v->validate();
  return v;
}

}  // namespace p2p::engine
