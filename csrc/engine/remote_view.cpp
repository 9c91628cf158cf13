#include "engine/remote_view.h"

#include "common/wire.h"
#include "core/runs.h"

namespace p2p::engine {
namespace {

constexpr uint32_t kTensorMagic = 0x54503250;  // "P2PT"
constexpr uint8_t kVersion = 1;
constexpr size_t kMaxDims = 64;

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

std::shared_ptr<RemoteView> RemoteView::view(int64_t new_offset, std::vector<int64_t> new_shape,
                                             std::vector<int64_t> new_strides) const {
  auto v = std::make_shared<RemoteView>();
  v->region = region;
  v->dtype = dtype;
  v->offset = new_offset;
  v->shape = std::move(new_shape);
  v->strides = std::move(new_strides);
  v->validate();
  return v;
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
