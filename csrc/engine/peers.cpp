// Peers: connection by introduction, control messages, user messages, notifications,
// liveness and failure. No world: a peer is whoever we were given an address of, or whoever
// introduced itself.
#include <algorithm>

#include "common/log.h"
#include "engine/staging.h"
#include "engine/worker.h"

namespace p2p::engine {
namespace {

constexpr uint64_t kMaxUserMessage = uint64_t{1} << 30;

std::string describe(const Peer& p) { return cat("peer ", hex(p.incarnation)); }

}  // namespace

ByteWriter Worker::message(MsgType type, const Peer& to) const {
  return begin_message(type, incarnation_, to.incarnation);
}

// Finds or creates the peer behind an engine address. A new peer gets its rails inserted in
// every local rail's address vector, then a HELLO; transfers to it wait for the answer.
Peer* Worker::peer_for(const std::string& address_bytes, bool explicit_connect) {
  EngineAddress a = EngineAddress::decode(address_bytes);
  P2P_CHECK(a.provider == provider_, ErrorKind::Value, "the peer uses provider ", a.provider,
            " but this engine uses ", provider_, "; both ends need the same provider");
  auto it = peers_.find(a.incarnation);
  if (it != peers_.end()) {
    Peer& p = *it->second;
    if (p.failed() && (explicit_connect || p.revivable)) revive(p);
    return &p;
  }
  auto owned = std::make_unique<Peer>();
  Peer& p = *owned;
  p.address = std::move(a);
  p.address_bytes = address_bytes;
  p.incarnation = p.address.incarnation;
  const size_t R = p.remote_rails();
  p.fi.reserve(rails_.size() * R);
  for (auto& rs : rails_)
    for (size_t r = 0; r < R; ++r) p.fi.push_back(rs.rail->insert(p.address.rails[r]));
  peers_.emplace(p.incarnation, std::move(owned));
  revive(p);
  return &p;
}

void Worker::revive(Peer& p) {
  p.state = PeerState::Connecting;
  p.failure = Status{};
  p.revivable = false;
  p.last_heard = now();
  p.connect_deadline = p.last_heard + config_.peer_timeout_s;
  send_hello(p);
}

void Worker::send_hello(Peer& p) {
  ByteWriter w = message(MsgType::Hello, p);
  w.put_bytes(address_);
  put_census(w);
  send_control(p, std::move(w));
}

void Worker::connect(uint64_t id, const std::string& address) {
  Peer* p;
  try {
    p = peer_for(address, true);
  } catch (const Error& e) {
    return report(id, Status::error(e.kind(), e.what()));
  }
  if (p->state == PeerState::Ready) return report(id, Status{});
  p->connect_waiters.push_back(id);
}

void Worker::disconnect(uint64_t id, const std::string& address) {
  EngineAddress a;
  try {
    a = EngineAddress::decode(address);
  } catch (const Error& e) {
    return report(id, Status::error(e.kind(), e.what()));
  }
  auto it = peers_.find(a.incarnation);
  if (it == peers_.end() || it->second->failed()) return report(id, Status{});
  Peer& p = *it->second;
  if (p.disconnect_id) return report(id, Status::error(ErrorKind::Value, "a disconnect from this peer is already under way"));
  p.disconnect_id = id;
  // A clean leave: what is in flight to the peer finishes first.
  if (p.busy == 0) finish_disconnect(p);
}

void Worker::finish_disconnect(Peer& p) {
  const uint64_t id = p.disconnect_id;
  p.disconnect_id = 0;
  if (p.state == PeerState::Ready || p.state == PeerState::Connecting)
    send_control(p, message(MsgType::Bye, p), nullptr, true);
  fail_peer(p, Status::error(ErrorKind::Peer, cat(describe(p), " was disconnected by this engine")),
            PeerState::Left);
  p.revivable = true;
  report(id, Status{});
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
    // A HELLO or BYE must reach a peer that is not (or no longer) Ready; everything else to
    // a failed peer is dropped by post_ops().
    rs.pending.push_back(op);
    outbox_.pop_front();
    any = true;
  }
  return any;
}

// ---------------------------------------------------------------------------------------------

void Worker::on_message(const char* data, size_t len) {
  ByteReader r(std::string_view(data, len), "control message");
  try {
    const MsgHeader h = read_header(r);
    if (h.type == MsgType::Hello || h.type == MsgType::HelloAck) return on_hello(h, r, h.type == MsgType::HelloAck);
    if (h.to != incarnation_) return;  // meant for an earlier process at this address
    auto it = peers_.find(h.from);
    if (it == peers_.end()) return;    // never introduced: drop
    Peer& p = *it->second;
    if (p.failed()) return;
    p.last_heard = now();
    switch (h.type) {
      case MsgType::Bye:
        fail_peer(p, Status::error(ErrorKind::Peer, cat(describe(p), " left")), PeerState::Left);
        break;
      case MsgType::Ping: {
        ByteWriter w = message(MsgType::Pong, p);
        w.put(r.get<uint64_t>());
        send_control(p, std::move(w));
        break;
      }
      case MsgType::Pong:
        break;
      case MsgType::User:
        on_user(p, r);
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
        on_fence_ack(p, r);
        break;
      case MsgType::RegionClosed:
        on_region_closed(p, r.get<uint64_t>());
        break;
      case MsgType::RegionReleased: {
        const uint64_t region = r.get<uint64_t>();
        for (auto& c : closing_)
          if (c.region->id == region) c.unreleased.erase(p.incarnation);
        break;
      }
      default:
        r.fail("unknown message type");
    }
  } catch (const Error& e) {
    P2P_LOG(Warn, "dropped a malformed control message: ", e.what());
  }
}

void Worker::on_hello(const MsgHeader& h, ByteReader& r, bool ack) {
  const std::string address(r.get_bytes(1 << 16));
  const uint64_t expected = ack ? r.get<uint64_t>() : 0;
  EngineAddress a = EngineAddress::decode(address);
  if (a.incarnation != h.from) r.fail("sender does not match its address");
  if (ack) {
    auto it = peers_.find(expected);
    if (it == peers_.end() || it->second->state != PeerState::Connecting) return;
    Peer& p = *it->second;
    read_census(p, r);
    if (h.from != expected) {
      return fail_peer(p, Status::error(ErrorKind::Peer,
                                        cat(describe(p), " restarted: the process at its address is now "
                                            "incarnation ", hex(h.from),
                                            "; handles from the old process are void")));
    }
    p.last_heard = now();
    return peer_ready(p);
  }
  // A HELLO: the sender introduces itself. An older process at the same address is gone.
  for (auto& [inc, q] : peers_) {
    if (inc != a.incarnation && !q->failed() && q->address.rails[0] == a.rails[0])
      fail_peer(*q, Status::error(ErrorKind::Peer, cat(describe(*q), " restarted (a new process now "
                                                           "answers at its address)")));
  }
  Peer* p;
  try {
    p = peer_for(address, true);  // no-op for a known peer; for a new one this sends our HELLO too
  } catch (const Error& e) {
    P2P_LOG(Warn, "ignored an introduction: ", e.what());
    return;
  }
  p->last_heard = now();
  read_census(*p, r);
  ByteWriter w = message(MsgType::HelloAck, *p);
  w.put_bytes(address_);
  w.put(h.to);
  put_census(w);
  send_control(*p, std::move(w));
  if (p->state != PeerState::Ready) peer_ready(*p);
}

void Worker::peer_ready(Peer& p) {
  p.state = PeerState::Ready;
  for (uint64_t id : p.connect_waiters) report(id, Status{});
  p.connect_waiters.clear();
  std::vector<Transfer*> waiting;
  waiting.swap(p.waiting);
  for (Transfer* t : waiting) {
    if (Status s = check_remote(*t); !s.ok()) {
      fail(*t, std::move(s));
      continue;
    }
    ready_to_generate(*t);
  }
}

void Worker::fail_peer(Peer& p, Status why, PeerState state) {
  if (p.failed()) return;
  P2P_LOG(Info, "peer ", hex(p.incarnation), " is gone: ", why.message);
  p.state = state;
  p.failure = why;
  for (uint64_t id : p.connect_waiters) report(id, why);
  p.connect_waiters.clear();
  std::vector<Transfer*> affected;
  for (auto& [id, t] : transfers_)
    if (t->peer == &p && !t->reported) affected.push_back(t.get());
  for (Transfer* t : affected) fail(*t, why);
  fail_jobs_of(p, why);
  // Posted ops to a dead peer may never complete (shm): their owners hear now and the credits
  // return; a completion that still arrives only frees the op.
  pool_->for_each_in_use([&](Op& op) {
    if (op.peer != &p || !op.posted || op.orphaned || op.kind == OpKind::Recv) return;
    op.orphaned = true;
    --rails_[op.rail].inflight;
    if (op.region) {
      auto& pin = orphan_pins_[op.region];
      if (!pin.first) pin.first = op.region->shared_from_this();
      ++pin.second;
    }
    OpOwner* owner = op.owner;
    op.owner = nullptr;
    if (owner) owner->op_done(*this, op, why);
  });
  for (auto& d : drivers_) forgets_.push_back({d.get(), &p});
  p.partial.clear();
  for (auto& c : closing_) c.unreleased.erase(p.incarnation);
  if (p.disconnect_id && state == PeerState::Dead) {
    report(p.disconnect_id, Status{});
    p.disconnect_id = 0;
  }
}

void Worker::ping(Peer& p) {
  const double t = now();
  if (t - p.last_ping < 0.05) return;  // one probe in flight is enough
  ByteWriter w = message(MsgType::Ping, p);
  w.put(++ping_nonce_);
  send_control(p, std::move(w));
  p.last_ping = t;
}

void Worker::check_peers() {
  const double t = now(), timeout = config_.peer_timeout_s;
  std::vector<std::pair<Peer*, Status>> dead;
  for (auto& [inc, owned] : peers_) {
    Peer& p = *owned;
    if (p.state == PeerState::Connecting && t > p.connect_deadline) {
      dead.push_back({&p, Status::error(ErrorKind::Peer, cat(describe(p), " did not answer within ",
                                                              timeout, " s (peer_timeout)"))});
    } else if (p.state == PeerState::Ready && p.busy > 0) {
      // Only a peer that something waits on is watched; an idle one costs nothing.
      if (t - p.last_heard > timeout) {
        dead.push_back({&p, Status::error(ErrorKind::Peer, cat(describe(p), " was silent for ",
                                                                timeout, " s (peer_timeout)"))});
      } else if (t - p.last_heard > timeout / 4 && t - p.last_ping > timeout / 4) {
        ping(p);
      }
    }
  }
  for (auto& [p, why] : dead) fail_peer(*p, why);
}

// ---------------------------------------------------------------------------------------------
// User messages and notifications.

void Worker::on_user(Peer& p, ByteReader& r) {
  const uint32_t id = r.get<uint32_t>();
  const uint64_t total = r.get<uint64_t>();
  const uint64_t offset = r.get<uint64_t>();
  const std::string_view part = r.get_bytes(kUserFragmentBytes);
  if (total > kMaxUserMessage) r.fail("message too large");
  std::string& buf = p.partial[id];
  // Fragments arrive in order (send-after-send), so each continues the last.
  if (offset != buf.size() || offset + part.size() > total) {
    p.partial.erase(id);
    r.fail("message fragment out of order");
  }
  if (buf.empty()) buf.reserve(total);
  buf.append(part);
  if (buf.size() < total) return;
  std::string payload = std::move(buf);
  p.partial.erase(id);
  if (!recv_waiters_.empty()) {
    const uint64_t waiter = recv_waiters_.front().id;
    recv_waiters_.erase(recv_waiters_.begin());
    return report(waiter, Status{}, std::move(payload), p.address_bytes);
  }
  inbox_.emplace_back(p.address_bytes, std::move(payload));
}

void Worker::recv(uint64_t id, double timeout_s) {
  if (!inbox_.empty()) {
    auto [address, payload] = std::move(inbox_.front());
    inbox_.erase(inbox_.begin());
    return report(id, Status{}, std::move(payload), std::move(address));
  }
  recv_waiters_.push_back({id, timeout_s > 0 ? now() + timeout_s : 0});
}

void Worker::on_notify(ByteReader& r) {
  const uint32_t tag = r.get<uint32_t>();
  const uint8_t kind = r.get<uint8_t>();
  Status status{static_cast<ErrorKind>(kind), std::string(r.get_bytes(kMessageBytes))};
  if (kind > static_cast<uint8_t>(ErrorKind::Remote)) r.fail("bad status");
  if (!status.ok()) status.message = cat("the sender's write failed: ", status.message);
  NotifyState& s = notify_[tag];
  if (!s.waiters.empty()) {
    const uint64_t waiter = s.waiters.front().id;
    s.waiters.erase(s.waiters.begin());
    return report(waiter, std::move(status));
  }
  s.arrived.push_back(std::move(status));
}

void Worker::notification(uint64_t id, uint32_t tag, double timeout_s) {
  NotifyState& s = notify_[tag];
  if (!s.arrived.empty()) {
    Status status = std::move(s.arrived.front());
    s.arrived.erase(s.arrived.begin());
    return report(id, std::move(status));
  }
  s.waiters.push_back({id, timeout_s > 0 ? now() + timeout_s : 0});
}

void Worker::cancel(uint64_t id) {
  const Status cancelled = Status::error(ErrorKind::Cancelled, "cancelled");
  auto drop = [&](std::vector<Waiter>& waiters) {
    for (size_t i = 0; i < waiters.size(); ++i) {
      if (waiters[i].id != id) continue;
      waiters.erase(waiters.begin() + i);
      report(id, cancelled);
      return true;
    }
    return false;
  };
  if (drop(recv_waiters_)) return;
  for (auto& [tag, s] : notify_)
    if (drop(s.waiters)) return;
  auto it = transfers_.find(id);
  if (it != transfers_.end()) fail(*it->second, cancelled);
}

}  // namespace p2p::engine
