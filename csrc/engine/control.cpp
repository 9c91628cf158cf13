// The control channel's worker side: messages between engines, queued on the ControlChannel
// (control_channel.h) and dispatched by type on arrival.
#include <algorithm>

#include "common/log.h"
#include "engine/worker.h"

namespace p2p::engine {

// Control messages wait in the channel's outbox for a free send buffer and op.
void Worker::send_control(Peer& p, ByteWriter&& w, OpOwner* owner, bool farewell) {
  control_.queue(p, std::move(w), owner, farewell);
}

void Worker::send(Peer& p, uint8_t route, std::string body) { send_control(p, message(RouteMessage{route, body}, p)); }

bool Worker::flush_outbox() {
  return control_.flush([this](Peer* p, OpOwner* owner) { return new_op(OpKind::Send, 0, owner, p); },
                        rails_[0].pending);
}


// Hellos come first (they introduce a sender we may not know yet), then what is meant for this
// process from a known peer; a goodbye is taken even from a failed peer.
void Worker::on_message(const char* data, size_t len) {
  try {
    Received m = decode_message(std::string_view(data, len));
    const MsgHeader& h = m.header;
    if (const auto* hello = std::get_if<Hello>(&m.body)) return on_hello(h, *hello);
    if (const auto* ack = std::get_if<HelloAck>(&m.body)) return on_hello_ack(h, *ack);
    if (h.to != incarnation_) return;  // meant for an earlier process at this address: its
                                       // sender finds out by a check (check())
    auto it = peers_.find(h.from);
    if (it == peers_.end()) return;    // never introduced: drop
    Peer& p = *it->second;
    if (const auto* bye = std::get_if<Bye>(&m.body)) return on_bye(p, bye->closing);
    if (p.failed()) return;
    p.live.heard(now());
    struct Dispatch {
      Worker& w;
      Peer& p;
      Message& body;
      void operator()(const UserFragment& m) { w.on_user(p, m); }
      void operator()(const UserAck& m) { w.on_user_ack(p, m); }
      void operator()(const Notify& m) { w.on_notify(m); }
      void operator()(const StageRequest&) { w.to_routes(p, body); }
      void operator()(const StageAck&) { w.to_routes(p, body); }
      void operator()(const Fence& m) { w.on_fence(p, m); }
      void operator()(const FenceAck& m) { w.acknowledged(p, m.id); }
      void operator()(const RegionClosed& m) { w.on_region_closed(p, m.id); }
      void operator()(const RegionReleased& m) { w.regions_.released(m.id, p.incarnation); }
      void operator()(const RouteMessage& m) {
        if (m.route < w.routes_.size()) w.routes_[m.route]->on_message(p, m.body);
      }
      void operator()(const Hello&) {}  // taken above
      void operator()(const HelloAck&) {}
      void operator()(const Bye&) {}
    };
    std::visit(Dispatch{*this, p, m.body}, m.body);
  } catch (const Error& e) {
    P2P_LOG(Warn, "dropped a malformed control message: ", e.what());
  }
}

// A message of a type a route owns (the staged route's requests and answers).
void Worker::to_routes(Peer& p, Message& m) {
  for (auto& r : routes_)
    if (r->on_control(p, m)) return;
}

}  // namespace p2p::engine
