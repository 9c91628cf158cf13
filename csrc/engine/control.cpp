// The control channel: messages between engines, one provider message each, sent from rail
// 0's send buffers (the outbox holds them until one is free) and dispatched by type on arrival.
#include <algorithm>

#include "common/log.h"
#include "engine/worker.h"

namespace p2p::engine {

ByteWriter Worker::message(MsgType type, const Peer& to) const {
  return begin_message(type, incarnation_, to.incarnation);
}

// Control messages wait in the outbox for a free send buffer and op.
void Worker::send_control(Peer& p, ByteWriter&& w, OpOwner* owner, bool farewell) {
  P2P_ASSERT(w.str().size() <= kMessageBytes);
  outbox_.push_back({&p, std::move(w.str()), owner, farewell});
}

bool Worker::flush_outbox() {
  bool any = false;
  RailState& rs = rails_[0];
  while (!outbox_.empty() && !free_send_.empty()) {
    Outgoing& out = outbox_.front();
    Op* op = new_op(OpKind::Send, 0, out.owner, out.peer);
    if (!op) break;
    const int32_t buf = free_send_.back();
    free_send_.pop_back();
    uint8_t* dst = control_.data() + static_cast<size_t>(buf) * kMessageBytes;
    std::copy(out.bytes.begin(), out.bytes.end(), dst);
    op->buffer = buf;
    op->set_buffer(dst, out.bytes.size(), control_mr_[0].desc);
    op->dest = out.peer->fi[0];  // local rail 0 -> remote rail 0
    op->farewell = out.farewell;
    op->hello = type_of(out.bytes) == MsgType::Hello;
    // A HELLO or BYE must reach a peer that is not (or no longer) Ready; everything else to
    // a failed peer is dropped by post_ops().
    rs.pending.push_back(op);
    outbox_.pop_front();
    any = true;
  }
  return any;
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
