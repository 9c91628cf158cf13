#include "core/messages.h"

namespace p2p::core {

void LiveRegions::write(ByteWriter& w) const {
  w.put(upto);
  w.put(static_cast<uint16_t>(ranges.size()));
  for (auto [first, last] : ranges) {
    w.put(first);
    w.put(last);
  }
}

LiveRegions LiveRegions::read(ByteReader& r) {
  LiveRegions live;
  live.upto = r.get<uint64_t>();
  live.ranges.resize(r.get<uint16_t>());
  for (auto& [first, last] : live.ranges) {
    first = r.get<uint64_t>();
    last = r.get<uint64_t>();
  }
  return live;
}

void Hello::write(ByteWriter& w) const {
  w.put_bytes(address);
  live.write(w);
}

Hello Hello::read(ByteReader& r) {
  Hello m;
  m.address = r.get_bytes(1 << 16);
  m.live = LiveRegions::read(r);
  return m;
}

void HelloAck::write(ByteWriter& w) const {
  w.put_bytes(address);
  w.put(expected);
  live.write(w);
}

HelloAck HelloAck::read(ByteReader& r) {
  HelloAck m;
  m.address = r.get_bytes(1 << 16);
  m.expected = r.get<uint64_t>();
  m.live = LiveRegions::read(r);
  return m;
}

void UserFragment::write(ByteWriter& w) const {
  w.put(id);
  w.put(total);
  w.put(offset);
  w.put_bytes(part);
}

UserFragment UserFragment::read(ByteReader& r) {
  UserFragment m;
  m.id = r.get<uint32_t>();
  m.total = r.get<uint64_t>();
  m.offset = r.get<uint64_t>();
  m.part = r.get_bytes(kUserFragmentBytes);
  if (m.total > kMaxUserMessageBytes) r.fail("message too large");
  return m;
}

namespace {

template <size_t I = 0>
Message read_body(MsgType type, ByteReader& r) {
  if constexpr (I == std::variant_size_v<Message>) {
    r.fail("unknown message type");
  } else {
    using M = std::variant_alternative_t<I, Message>;
    if (type == M::kType) return M::read(r);
    return read_body<I + 1>(type, r);
  }
}

}  // namespace

Received decode_message(std::string_view bytes) {
  ByteReader r(bytes, "control message");
  const MsgHeader header = read_header(r);
  return {header, read_body(header.type, r)};
}

}  // namespace p2p::core
