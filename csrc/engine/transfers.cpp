// Transfers: a write_slices / read_slices / send call from the moment the worker owns it: its
// regions and peer resolved, handed to the first route of the registry that takes it
// (routes/registry.h; the fabric route takes the rest), finished as its route reports.
#include <algorithm>

#include "common/clock.h"
#include "common/log.h"
#include "engine/worker.h"

namespace p2p::engine {

using namespace core;
namespace {

// Refuses handles the owner told us are stale (before anything is posted to it).
Status check_remote(const Transfer& t) {
  const Peer& p = *t.peer;
  for (const auto& r : t.remote) {
    if (r->rails != p.remote_rails())
      return Status::error(ErrorKind::Value, "a RemoteTensor's key table does not match its owner's rails");
    if (p.region_gone(r->id))
      return Status::error(ErrorKind::Closed, cat("region ", r->id, " of peer ", hex(p.incarnation),
                                                  " was deregistered by its owner"));
  }
  return Status{};
}

}  // namespace

void Worker::start(Transfer* raw) {
  assert_on_worker();
  Transfer& t = *raw;
  transfers_.add(std::unique_ptr<Transfer>(raw));
  if (t.timeout_s <= 0) t.timeout_s = config_.timeout_s;
  t.deadline = now() + t.timeout_s;
  for (uint64_t id : t.local_ids) {
    std::shared_ptr<Region> region = regions_.find(id);
    if (!region) return fail(t, Status::error(ErrorKind::Closed, cat("region ", id, " was deregistered")));
    t.local.push_back(std::move(region));
  }
  try {
    t.peer = peers_.peer_for(t.peer_address, Peers::Contact::Implicit);
  } catch (const Error& e) {
    return fail(t, Status::error(e.kind(), e.what()));
  }
  Peer& p = *t.peer;
  peers_.begin_work(p);
  if (p.refuses()) return fail(t, p.failure);
  if (p.waits() || p.revive_when_drained) {
    t.enter(TransferState::WaitingForPeer);
    p.waiting.push_back(&t);  // check_remote() needs the live regions its answer lists
    return;
  }
  if (Status s = check_remote(t); !s.ok()) return fail(t, std::move(s));
  offer(t, 0);
}

void Worker::offer(Transfer& t, size_t first) {
  for (size_t i = first; i < routes_.size(); ++i)
    if (routes_[i]->take(t)) return;
  P2P_ASSERT(!"the fabric route takes every transfer");
}

void Worker::started(Transfer& t, uint8_t route) {
  t.route = route;
  answer_orders(t);
}

void Worker::pass_on(Transfer& t) {
  const size_t next = t.route + 1u;
  t.route = Transfer::kNoRoute;
  offer(t, next);
}

// What a stream that follows t waits on: its route's answer, else its future.
StreamOrder Worker::order_of(const Transfer& t) {
  if (t.reported()) return {};
  if (t.routed()) return routes_[t.route]->stream_order(t);
  return {StreamOrder::Future};
}

void Worker::stream_order(uint64_t id, StreamOrderAnswer answer) {
  const Transfer* found = transfers_.find(id);
  // Not a transfer (a notification, a receive), or one that ended: its future says when.
  if (!found) return answer->set_value({StreamOrder::Future});
  const Transfer& t = *found;
  if (t.state == TransferState::WaitingForPeer) {  // no route yet
    order_waits_[id].push_back(std::move(answer));
    return;
  }
  answer->set_value(order_of(t));
}

void Worker::answer_orders(const Transfer& t) {
  if (order_waits_.empty()) return;
  auto it = order_waits_.find(t.id);
  if (it == order_waits_.end()) return;
  for (auto& answer : it->second) answer->set_value(order_of(t));  // an event each: each is recycled
  order_waits_.erase(it);
}

std::string Worker::route(const std::string& address, const RemoteRegion* region) {
  const EngineAddress a = EngineAddress::decode(address);
  for (auto& r : routes_)
    if (r->reaches(a, region)) return r->name();
  P2P_ASSERT(!"the fabric route reaches every peer");
  return {};
}

void Worker::send_user_message(Transfer& t) {
  // Fragments go out in order on one rail pair (send-after-send order); the receiver
  // reassembles by message id.
  // The future completes once the receiver acknowledges the whole message (on_user_ack): a
  // process that took the peer's address drops it, being meant for its predecessor, and the
  // missing acknowledgement leads to a check that names the restart.
  const uint32_t id = t.peer->next_message++;
  t.peer->unacked[id] = t.id;
  const uint64_t total = t.payload.size();
  uint64_t offset = 0;
  do {
    const uint64_t len = std::min<uint64_t>(total - offset, kUserFragmentBytes);
    ++t.pending;
    peers_.send(*t.peer, peers_.message(UserFragment{id, total, offset, std::string_view(t.payload).substr(offset, len)}, *t.peer),
                &t);
    offset += len;
  } while (offset < total);
  t.payload.clear();
  t.payload.shrink_to_fit();
}

void Worker::done(Transfer& t, const Status& status) {
  if (!status.ok() && t.status.ok()) t.status = status;  // final: no check of the peer
  transfer_op_done(t, {});
}

void Worker::transfer_op_done(Transfer& t, const Status& status) {
  assert_on_worker();
  P2P_ASSERT(t.pending > 0);
  --t.pending;
  if (!status.ok() && t.status.ok()) {
    t.status = status;
    // A refusal may come from the peer, or from a new process that took its address: the
    // caller hears once a check of the peer tells which (check(), which op_failed() starts).
    // A lost connection fails the call at once: what was on it came back with the loss.
    t.held = status.kind == ErrorKind::Remote && t.peer && !t.peer->failed();
  }
  advance(t);
}

void Worker::advance(Transfer& t) {
  assert_on_worker();
  Route* route = t.routed() ? routes_[t.route].get() : nullptr;
  switch (t.next_step(route && route->confirms(t))) {
    case TransferStep::Wait:
      if (route) route->waiting(t);
      break;
    case TransferStep::AwaitAck:  // sent, not yet acknowledged (acknowledged())
      t.enter(TransferState::AwaitingAck);
      return;
    case TransferStep::Confirm:
      t.enter(TransferState::AwaitingAck);  // a failing peer or the deadline fails it meanwhile
      route->confirm(t);
      return;
    case TransferStep::Report:
      finish(t, t.status);
      break;
  }
  maybe_free(t);
}

void Worker::acknowledged(Peer& p, uint64_t transfer) {
  Transfer* found = transfers_.find(transfer);
  if (!found || found->peer != &p) return;
  Transfer& t = *found;
  t.acked = true;
  // A message's acknowledgement may come before its own send completion, which then moves it.
  if (t.state == TransferState::AwaitingAck) advance(t);
}

void Worker::finish(Transfer& t, Status status) {
  if (t.reported()) return;
  if (t.status.ok() && !status.ok()) t.status = std::move(status);
  Peer* p = t.peer;
  const bool peer_alive = p && !p->failed();
  if (t.notify && t.state != TransferState::Notifying && peer_alive) {
    // The receiver's notification completes with this status. On success the future waits
    // for the notice to leave, so "future done" implies "notice sent".
    ByteWriter w = peers_.message(Notify{t.tag, t.status.kind, t.status.message}, *p);
    if (t.status.ok()) {
      t.enter(TransferState::Notifying);
      ++t.pending;
      peers_.send(*p, std::move(w), &t);
      return;
    }
    peers_.send(*p, std::move(w));
  }
  if (p && t.state == TransferState::WaitingForPeer) {
    auto& w = p->waiting;
    w.erase(std::remove(w.begin(), w.end(), &t), w.end());
  }
  t.enter(TransferState::Reported);
  answer_orders(t);
  // A failure is told once nothing of the call is out: its ops drain (a failed peer's are
  // flushed as its connections are cut), its copies end; then no byte of it moves.
  if (t.status.ok() || t.pending == 0)
    reports_.add(t.id, t.status);
  else
    t.report_due = true;
}

void Worker::fail(Transfer& t, Status status) {
  const bool given_up = status.kind == ErrorKind::Timeout || status.kind == ErrorKind::Cancelled;
  finish(t, std::move(status));
  if (given_up && t.report_due) take_back(t);
  maybe_free(t);
}

// NOTE: a call timed out or cancelled while its ops are posted to a peer that does not serve
// them (stopped, or behind a full link) would otherwise be told only when the peer fails; its
// connections are cut instead, so the call is told at once and its other calls in flight fail
// with it (a lost connection), and a check of the peer follows (Peers::op_failed).
void Worker::take_back(Transfer& t) {
  Peer* p = t.peer;
  if (!p || p->failed() || posted_ops([&](const Op& op) { return op.owner == &t; }) == 0) return;
  peers_.cut(*p);
  t.take_back_until = now() + kCancelMarginS;  // then what the provider still holds is let go
}

// A call taken back whose provider has not returned its ops in time (shm): they are orphaned.
void Worker::let_go(Transfer& t, double now) {
  if (!t.report_due || t.take_back_until == 0 || now < t.take_back_until) return;
  t.take_back_until = 0;
  auto held = [&](const Op& op) { return op.owner == &t; };
  if (const size_t out = posted_ops(held)) orphan(held, out, cat("peer ", hex(t.peer->incarnation)));
}

void Worker::maybe_free(Transfer& t) {
  if (!t.reported() || t.pending > 0) return;
  if (t.report_due) {
    t.report_due = false;
    reports_.add(t.id, t.status);
  }
  if (t.queued) return;
  if (t.cuda_event) copier_->release_event(t.cuda_event);
  Peer* p = t.peer;
  finished_->give(transfers_.remove(t));  // t is gone from here on
  if (!p) return;
  if (!p->to_release.empty()) release_regions(*p);
  peers_.end_work(*p);
}

void Worker::cancel(uint64_t id) {
  assert_on_worker();
  if (inbox_.cancel(id)) return;
  if (Transfer* t = transfers_.find(id)) fail(*t, Status::error(ErrorKind::Cancelled, "cancelled"));
}

// ---------------------------------------------------------------------------------------------
// A peer answered or failed (PeerEvents): its transfers go on, or end.

// Transfers held for a check report their own failure (the peer did not restart); those that
// waited for the peer take their route.
void Worker::peer_ready(Peer& p) {
  std::vector<Transfer*> held;
  transfers_.for_each([&](Transfer& t) {
    if (t.peer == &p && t.held) held.push_back(&t);
  });
  for (Transfer* t : held) {
    t->held = false;
    fail(*t, t->status);
  }
  std::vector<Transfer*> waiting;
  waiting.swap(p.waiting);
  for (Transfer* t : waiting) {
    if (Status s = check_remote(*t); !s.ok()) {
      fail(*t, std::move(s));
      continue;
    }
    offer(*t, 0);
  }
}

// The peer's transfers fail; the routes let go of their work for it (the staged route's jobs
// report into their transfers). The rail threads drop the ops to it they hold; a dead peer's
// connections are then cut (Peers::cut, once every Forget marker is back): the provider flushes what
// was posted to it, and the failed transfers report as their ops come back (finish()). What a
// provider does not give back within kCancelMarginS is let go (drain_peer()).
void Worker::peer_failed(const PeerFailure& f) {
  Peer& p = f.peer;
  std::vector<Transfer*> affected;
  transfers_.for_each([&](Transfer& t) {
    if (t.peer == &p && !t.reported()) affected.push_back(&t);
  });
  for (Transfer* t : affected) {
    if (t->held) t->status = f.why;  // what the check found out is the answer
    fail(*t, f.why);
  }
  for (auto& r : routes_) r->peer_failed(p);
  const size_t forgets = rails_->forget(&p);
  // A peer that left said goodbye or was let go with nothing in flight: its connections stay.
  if (f.state == PeerState::Dead) {
    p.drain_until = now() + kCancelMarginS;
    p.forgets_out = forgets;
    if (forgets == 0) peers_.cut(p);
  }
  regions_.forget_peer(p.incarnation);
}

// While p drains: done once nothing posted to it is out; past its margin, what the provider
// still holds is orphaned (its owners hear now, its regions stay pinned until it comes back).
// NOTE: tcp and verbs (ofi_rxm) flush at once when cut; shm cannot cancel an op its peer has
// not served, so a frozen shm peer's ops are orphaned: its failure says so (docs/failures.md).
void Worker::drain_peer(Peer& p, double t) {
  auto held = [&](const Op& op) { return op.peer == &p; };
  const size_t out = posted_ops(held);
  if (out == 0 && p.forgets_out == 0) return peers_.drained(p);
  if (t < p.drain_until) return;
  orphan(held, out, cat("peer ", hex(p.incarnation)));
  peers_.drained(p);
}

// The posted ops `held` picks (not receives) that the provider has not given back
// kCancelMarginS after they were taken back: their owners hear now, with a warning and an error
// that say their bytes may still move; the regions they point into stay pinned until they return.
template <typename Held>
void Worker::orphan(const Held& held, size_t out, const std::string& to) {
  P2P_LOG(Warn, "the provider still holds ", out, " operations to ", to, " ", kCancelMarginS,
          " s after they were taken back: it cannot cancel them, and their bytes may still move");
  const Status why = Status::error(ErrorKind::Peer, cat("the provider could not cancel ", out, " operations to ", to,
                                                        ", whose bytes may still move"));
  rails_->pool().for_each_in_use([&](Op& op) {
    if (!op.posted || op.orphaned || op.kind == OpKind::Recv || op.kind == OpKind::Forget || !held(op)) return;
    op.orphaned = true;
    rails_->uncount(op);
    if (op.region) {
      auto& pin = orphan_pins_[op.region];
      if (!pin.first) pin.first = op.region->shared_from_this();
      ++pin.second;
    }
    OpOwner* owner = op.owner;
    op.owner = nullptr;
    if (owner) owner->op_done(*this, op, why);
  });
}

template <typename Held>
size_t Worker::posted_ops(const Held& held) {
  size_t out = 0;
  rails_->pool().for_each_in_use([&](Op& op) {
    out += op.posted && !op.orphaned && op.kind != OpKind::Recv && op.kind != OpKind::Forget && held(op);
  });
  return out;
}

}  // namespace p2p::engine
