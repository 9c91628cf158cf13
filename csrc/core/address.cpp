#include "core/address.h"

#include "common/wire.h"

namespace p2p::core {
namespace {

constexpr uint32_t kAddressMagic = 0x41503250;  // "P2PA"
constexpr uint32_t kRegionMagic = 0x52503250;   // "P2PR"
constexpr uint8_t kVersion = 3;
constexpr size_t kMaxRails = 1024;
constexpr size_t kMaxName = 4096;
constexpr size_t kMaxHost = 256;
constexpr uint8_t kMaxRoutes = 8;  // EngineAddress::routes has a bit for each
constexpr size_t kRouteBytes = 1024;

}  // namespace

std::string EngineAddress::encode() const {
  ByteWriter w;
  w.put(kAddressMagic);
  w.put(kVersion);
  w.put_bytes(provider);
  w.put(incarnation);
  w.put(static_cast<uint16_t>(rails.size()));
  for (const auto& r : rails) w.put_bytes(r);
  w.put_bytes(host);
  w.put(pid);
  w.put(routes);
  w.seal();
  return std::move(w.str());
}

EngineAddress EngineAddress::decode(std::string_view bytes) {
  ByteReader r(bytes, "engine address");
  r.check_crc();
  if (r.get<uint32_t>() != kAddressMagic) r.fail("not a torch_p2p engine address");
  if (r.get<uint8_t>() != kVersion) r.fail("unsupported version");
  EngineAddress a;
  a.provider = r.get_bytes(256);
  a.incarnation = r.get<uint64_t>();
  const uint16_t n = r.get<uint16_t>();
  if (n == 0 || n > kMaxRails) r.fail("bad rail count");
  for (uint16_t i = 0; i < n; ++i) {
    std::string rail(r.get_bytes(kMaxName));
    if (rail.empty()) r.fail("empty rail address");
    a.rails.push_back(std::move(rail));
  }
  a.host = r.get_bytes(kMaxHost);
  a.pid = r.get<uint32_t>();
  a.routes = r.get<uint8_t>();
  r.expect_end();
  return a;
}

void RemoteRegion::encode(std::string& out) const {
  ByteWriter w;
  w.put(kRegionMagic);
  w.put(kVersion);
  w.put_bytes(owner);
  w.put(id);
  w.put(nbytes);
  w.put(access);
  w.put(static_cast<uint8_t>(!on_nics));
  w.put(device_type);
  w.put(device_index);
  w.put(piece_bytes);
  w.put(rails);
  w.put(static_cast<uint8_t>(route_bytes.size()));
  for (const auto& [route, bytes] : route_bytes) {
    w.put(route);
    w.put_bytes(bytes);
  }
  for (size_t i = 0; i < base.size(); ++i) {
    w.put(base[i]);
    w.put(key[i]);
  }
  w.seal();
  out.append(w.str());
}

std::shared_ptr<RemoteRegion> RemoteRegion::decode(std::string_view bytes) {
  ByteReader r(bytes, "remote region");
  r.check_crc();
  if (r.get<uint32_t>() != kRegionMagic) r.fail("not a torch_p2p region descriptor");
  if (r.get<uint8_t>() != kVersion) r.fail("unsupported version");
  auto g = std::make_shared<RemoteRegion>();
  g->owner = r.get_bytes(1 << 20);
  g->incarnation = EngineAddress::decode(g->owner).incarnation;
  g->id = r.get<uint64_t>();
  g->nbytes = r.get<uint64_t>();
  g->access = r.get<uint8_t>();
  const uint8_t staged = r.get<uint8_t>();
  g->device_type = r.get<int8_t>();
  g->device_index = r.get<int16_t>();
  g->piece_bytes = r.get<uint64_t>();
  g->rails = r.get<uint16_t>();
  const uint8_t count = r.get<uint8_t>();
  if (count > kMaxRoutes) r.fail("bad route count");
  for (uint8_t i = 0; i < count; ++i) {
    const uint8_t route = r.get<uint8_t>();
    if (route >= kMaxRoutes || !g->route_bytes.emplace(route, r.get_bytes(kRouteBytes)).second) r.fail("bad route id");
  }
  if (g->nbytes == 0) r.fail("empty region");
  if (g->access & ~(kRemoteRead | kRemoteWrite)) r.fail("bad access bits");
  if (staged > 1) r.fail("bad flags");
  g->on_nics = !staged;
  if (g->device_type < 0 || g->device_type > 1) r.fail("bad device type");
  if (g->piece_bytes == 0 || g->rails == 0 || g->rails > kMaxRails) r.fail("bad layout");
  // The key table's size follows from the fields above; check it against what is left
  // before allocating anything.
  const uint64_t pieces = g->pieces();
  if (pieces > r.remaining() / 16 / g->rails) r.fail("truncated key table");
  const size_t entries = pieces * g->rails;
  if (r.remaining() != entries * 16) r.fail("key table size does not match the region size");
  g->base.resize(entries);
  g->key.resize(entries);
  for (size_t i = 0; i < entries; ++i) {
    g->base[i] = r.get<uint64_t>();
    g->key[i] = r.get<uint64_t>();
  }
  r.expect_end();
  return g;
}

}  // namespace p2p::core
