#include "routes/staged/messages.h"

#include "core/messages.h"

namespace p2p::staged {

void StageRequest::write(ByteWriter& w) const {
  w.put(kStageRequest);
  w.put(request);
  w.put(dir);
  w.put(region_id);
  w.put(bytes);
  w.put(static_cast<uint16_t>(base.size()));
  for (size_t i = 0; i < base.size(); ++i) {
    w.put(base[i]);
    w.put(key[i]);
  }
  w.put(slot);
  w.put(static_cast<uint16_t>(runs.size()));
  for (const core::Run& run : runs) {
    w.put(run.remote);
    w.put(static_cast<uint32_t>(run.len));
  }
}

StageRequest StageRequest::read(ByteReader& r) {
  StageRequest m;
  m.request = r.get<uint64_t>();
  m.dir = r.get<uint8_t>();
  m.region_id = r.get<uint64_t>();
  m.bytes = r.get<uint64_t>();
  const uint16_t rails = r.get<uint16_t>();
  if (m.dir > kOwnerPushes) r.fail("bad stage request");
  m.base.resize(rails);
  m.key.resize(rails);
  for (uint16_t i = 0; i < rails; ++i) {
    m.base[i] = r.get<uint64_t>();
    m.key[i] = r.get<uint64_t>();
  }
  m.slot = r.get<uint64_t>();
  m.runs.resize(r.get<uint16_t>());
  for (core::Run& run : m.runs) {
    run.remote = r.get<uint64_t>();
    run.len = r.get<uint32_t>();
  }
  r.expect_end();
  return m;
}

void StageAck::write(ByteWriter& w) const {
  w.put(kStageAck);
  w.put(id);
  w.put(static_cast<uint8_t>(kind));
  w.put_bytes(message.substr(0, 1024));
}

StageAck StageAck::read(ByteReader& r) {
  StageAck m;
  m.id = r.get<uint64_t>();
  const uint8_t kind = r.get<uint8_t>();
  if (!is_error_kind(kind)) r.fail("bad status");
  m.kind = static_cast<ErrorKind>(kind);
  m.message = r.get_bytes(core::kMessageBytes);
  r.expect_end();
  return m;
}

}  // namespace p2p::staged
