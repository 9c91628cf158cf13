#include "routes/fabric/messages.h"

#include "common/wire.h"

namespace p2p::routes::fabric {

std::string write_message(const Message& m) {
  ByteWriter w;
  w.put(m.kind);
  if (m.kind != kKeepPolling) w.put(m.transfer);
  return std::move(w.str());
}

Message read_message(std::string_view body) {
  ByteReader r(body, "fabric route message");
  Message m{r.get<uint8_t>()};
  if (m.kind != kFence && m.kind != kFenceAck && m.kind != kKeepPolling) r.fail("unknown kind");
  if (m.kind != kKeepPolling) m.transfer = r.get<uint64_t>();
  r.expect_end();
  return m;
}

}  // namespace p2p::routes::fabric
