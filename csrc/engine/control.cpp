// The control channel's worker side: messages between engines, queued on the ControlChannel
// (control_channel.h) and dispatched by type on arrival.
#include <algorithm>

#include "common/log.h"
#include "engine/worker.h"

namespace p2p::engine {

ByteWriter Worker::message(MsgType type, const Peer& to) const {
  return begin_message(type, incarnation_, to.incarnation);
}

// Control messages wait in the channel's outbox for a free send buffer and op.
void Worker::send_control(Peer& p, ByteWriter&& w, OpOwner* owner, bool farewell) {
  control_.queue(p, std::move(w), owner, farewell);
}

bool Worker::flush_outbox() {
  return control_.flush([this](Peer* p, OpOwner* owner) { return new_op(OpKind::Send, 0, owner, p); },
                        rails_[0].pending);
}


void Worker::on_message(const char* data, size_t len) {
  ByteReader r(std::string_view(data, len), "control message");
  try {
    const MsgHeader h = read_header(r);
    if (h.type == MsgType::Hello || h.type == MsgType::HelloAck) return on_hello(h, r, h.type == MsgType::HelloAck);
    if (h.to != incarnation_) return;  // meant for an earlier process at this address: its
                                       // sender finds out by a check (check())
    auto it = peers_.find(h.from);
    if (it == peers_.end()) return;    // never introduced: drop
    Peer& p = *it->second;
    if (h.type == MsgType::Bye) return on_bye(p, r.get<uint8_t>() != 0);
    if (p.failed()) return;
    p.live.heard(now());
    switch (h.type) {
      case MsgType::User:
        on_user(p, r);
        break;
      case MsgType::UserAck:
        on_user_ack(p, r);
        break;
      case MsgType::Notify:
        on_notify(r);
        break;
      case MsgType::StageReq:
        on_stage_request(p, r);
        break;
      case MsgType::StageAck:
        on_stage_ack(r);
        break;
      case MsgType::Fence:
        on_fence(p, r);
        break;
      case MsgType::FenceAck:
        acknowledged(p, r.get<uint64_t>());
        break;
      case MsgType::RegionClosed:
        on_region_closed(p, r.get<uint64_t>());
        break;
      case MsgType::RegionReleased:
        regions_.released(r.get<uint64_t>(), p.incarnation);
        break;
      default:
        r.fail("unknown message type");
    }
  } catch (const Error& e) {
    P2P_LOG(Warn, "dropped a malformed control message: ", e.what());
  }
}


}  // namespace p2p::engine
