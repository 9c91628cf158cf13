// Peers: connection by introduction, disconnection, liveness checks and failure (the control
// channel is control.cpp, user messages user_messages.cpp). No world: a peer is whoever we were given an address of, or whoever
// introduced itself.
#include <poll.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/log.h"
#include "engine/worker.h"

namespace p2p::engine {
namespace {

std::string describe(const Peer& p) { return cat("peer ", hex(p.incarnation)); }

// The address a HELLO or its answer carries, which must be its sender's.
EngineAddress sender_address(const MsgHeader& h, std::string_view address) {
  EngineAddress a = EngineAddress::decode(std::string(address));
  if (a.incarnation != h.from)
    throw Error(ErrorKind::Value, "invalid control message: sender does not match its address");
  return a;
}

void take_live_regions(Peer& p, const LiveRegions& live) {
  p.live_regions_upto = live.upto;
  p.live_regions = live.ranges;
}

}  // namespace

// Finds or creates the peer behind an engine address. A new peer gets its rails inserted in
// every local rail's address vector, then a HELLO; transfers to it wait for the answer.
// An incarnation is one process, at one set of rails. Once it has answered from its rails, an
// address naming it at others is forged or corrupt and is refused. Until then addresses are
// only claims (the first one may have been the forgery): another is tried once the attempt
// under way has failed, or at once when the process itself introduces itself from it. One
// attempt at a time: thousands of addresses of one incarnation at dead ports, each starting a
// HELLO, would keep rail 0's send buffers busy and hold up a real peer's introduction past
// peer_timeout.
Peer* Worker::peer_for(const std::string& address_bytes, Contact how) {
  // Every transfer names its peer by address: the same bytes as the last peer's, of a peer that
  // has not failed, find it without decoding them (which allocates). Peers are never erased.
  if (last_peer_ && !last_peer_->failed() && last_peer_->address_bytes == address_bytes) return last_peer_;
  last_peer_ = find_peer(address_bytes, how);
  return last_peer_;
}

Peer* Worker::find_peer(const std::string& address_bytes, Contact how) {
  EngineAddress a = EngineAddress::decode(address_bytes);
  P2P_CHECK(a.provider == provider_, ErrorKind::Value, "the peer uses provider ", a.provider,
            " but this engine uses ", provider_, "; both ends need the same provider");
  auto it = peers_.find(a.incarnation);
  if (it != peers_.end()) {
    Peer& p = *it->second;
    if (p.address.rails != a.rails) {
      P2P_CHECK(!p.confirmed, ErrorKind::Value, "the address names ", describe(p), ", which answered "
                "this engine from other endpoints: a forged or corrupt address or handle");
      P2P_CHECK(p.failed() || how == Contact::Introduction, ErrorKind::Value, "the address names ",
                describe(p), " at other endpoints than the ones this engine is trying now; try it "
                "again once that attempt has ended (within peer_timeout)");
      readdress(p, std::move(a), address_bytes);
      revive(p);
    } else if (p.failed() && !p.closed && (how != Contact::Implicit || p.revivable)) {
      revive(p);
    }
    return &p;
  }
  auto owned = std::make_unique<Peer>(config_.peer_timeout_s);
  Peer& p = *owned;
  p.incarnation = a.incarnation;
  readdress(p, std::move(a), address_bytes);
  peers_.emplace(p.incarnation, std::move(owned));
  revive(p);
  return &p;
}

void Worker::readdress(Peer& p, EngineAddress a, const std::string& address_bytes) {
  std::vector<fi_addr_t> fi;
  fi.reserve(rails_.size() * a.rails.size());
  for (auto& rs : rails_)
    for (const std::string& rail : a.rails) fi.push_back(rs.rail->insert(rail));
  p.fi = std::move(fi);
  p.address = std::move(a);
  p.address_bytes = address_bytes;
}

void Worker::revive(Peer& p) {
  p.live.connect(now());
  p.failure = Status{};
  p.revivable = false;
  send_hello(p);
}

void Worker::send_hello(Peer& p) {
  send_control(p, message(Hello{address_, regions_.live()}, p));
}

// Asks a Ready peer to introduce itself again, after one of our ops to it failed (a refusal
// or a lost connection) or after a silence: the answer says whether it is still there and
// still the same process. A HELLO rather than a ping, since a process that replaced it at
// its address does not know us and can answer only a message that carries our address.
void Worker::check(Peer& p, double deadline) {
  if (p.live.start_check(deadline)) send_hello(p);
}

// A HELLO lost while the connection under it is torn down (tcp;ofi_rxm drops a connection
// whose RMA the owner refused) is sent again after a pause (Liveness::hello_failed); any
// other failure is final.
void Worker::on_hello_failed(Peer& p, int err, int prov_errno, const Status& status) {
  const auto tearing_down = [](int e) { return e == FI_ENOTCONN || e == EPIPE || e == FI_ECONNRESET || e == FI_ECONNABORTED; };
  const bool transient = tearing_down(err) || (err == FI_ECANCELED && tearing_down(prov_errno));
  const double t = now();
  switch (p.live.hello_failed(t, transient)) {
    case Liveness::Retry::Ignore:
      return;
    case Liveness::Retry::GiveUp:
      return fail_peer(p, status);
    case Liveness::Retry::Later:
      P2P_LOG(Info, "introducing ourselves to ", describe(p), " again in ", p.live.retry_at() - t,
              " s after: ", status.message);
  }
}

void Worker::connect(uint64_t id, const std::string& address) {
  assert_on_worker();
  Peer* p;
  try {
    p = peer_for(address, Contact::Connect);
  } catch (const Error& e) {
    return report(id, Status::error(e.kind(), e.what()));
  }
  if (p->state() == PeerState::Ready) return report(id, Status{});
  if (p->failed()) return report(id, p->failure);  // it closed: that process is gone
  p->connect_waiters.push_back(id);
}

void Worker::disconnect(uint64_t id, const std::string& address) {
  assert_on_worker();
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
  if (p.state() == PeerState::Ready || p.state() == PeerState::Connecting)
    send_control(p, bye(p, false), nullptr, true);
  fail_peer(p, Status::error(ErrorKind::Peer, cat(describe(p), " was disconnected by this engine")),
            PeerState::Left);
  p.revivable = true;
  report(id, Status{});
}

// ---------------------------------------------------------------------------------------------

ByteWriter Worker::bye(const Peer& to, bool closing) const { return message(Bye{closing}, to); }

// The peer leaves us, or closes. A closed peer must never be sent anything again, not even our
// BYE (usable()) or a HELLO to reconnect: shm (libfabric 1.17) stalls every later completion
// of our endpoint behind a command that a closed peer never answers. That happens when a
// disconnect() crosses the peer's close(), or when a write would reconnect to a peer that
// closed after we disconnected from it.
void Worker::on_bye(Peer& p, bool closing) {
  p.closed |= closing;
  const Status left =
      Status::error(ErrorKind::Peer, cat(describe(p), closing ? " left: its engine closed" : " left"));
  if (p.failed())
    p.failure = left;
  else
    fail_peer(p, left, PeerState::Left);
}

// The answer to our HELLO: the peer is there, and still the process we meant, or a new one.
void Worker::on_hello_ack(const MsgHeader& h, const HelloAck& m) {
  EngineAddress a = sender_address(h, m.address);
  auto it = peers_.find(m.expected);
  if (it == peers_.end() || !it->second->waits()) return;
  Peer& p = *it->second;
  if (h.from != m.expected) {
    if (a.rails[0] != p.address.rails[0]) return;  // from an address it no longer has
    return fail_peer(p, Status::error(ErrorKind::Peer,
                                      cat(describe(p), " restarted: the process at its address is now "
                                          "incarnation ", hex(h.from),
                                          "; handles from the old process are void")));
  }
  if (a.rails != p.address.rails) {  // the process itself says where it is
    if (p.confirmed) return;
    readdress(p, std::move(a), std::string(m.address));
  }
  take_live_regions(p, m.live);
  p.live.heard(now());
  peer_ready(p);
}

// A HELLO: the sender introduces itself. An older process at the same address is gone.
void Worker::on_hello(const MsgHeader& h, const Hello& m) {
  const EngineAddress a = sender_address(h, m.address);
  for (auto& [inc, q] : peers_) {
    if (inc != a.incarnation && !q->failed() && q->address.rails[0] == a.rails[0])
      fail_peer(*q, Status::error(ErrorKind::Peer, cat(describe(*q), " restarted (a new process now "
                                                           "answers at its address)")));
  }
  Peer* p;
  try {
    p = peer_for(std::string(m.address), Contact::Introduction);  // for a new peer this sends our HELLO too
  } catch (const Error& e) {
    P2P_LOG(Warn, "ignored an introduction: ", e.what());
    return;
  }
  p->live.heard(now());
  take_live_regions(*p, m.live);
  send_control(*p, message(HelloAck{address_, h.to, regions_.live()}, *p));
  if (p->waits()) peer_ready(*p);
}

// The peer answered as itself: what waited on that goes on, and transfers held for a check
// report their own failure (the peer did not restart).
void Worker::peer_ready(Peer& p) {
  p.live.answered();
  p.confirmed = true;
  for (uint64_t id : p.connect_waiters) report(id, Status{});
  p.connect_waiters.clear();
  std::vector<Transfer*> held;
  for (auto& [id, t] : transfers_)
    if (t->peer == &p && t->held) held.push_back(t.get());
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
    ready_to_generate(*t);
  }
}

// A peer's failure is one event that each part keeping something of the peer reacts to, in this
// order: the peer's record (failed from now on), then what waits on it and reports (connects,
// transfers, the routes' work for it (the staged route's jobs report into their transfers),
// the posted ops), then what only remembers it (the rail threads, the region table's pending
// releases, the record's messages and process watch), and last a disconnect that a death
// completes.
void Worker::fail_peer(Peer& p, Status why, PeerState state) {
  assert_on_worker();
  if (p.failed()) return;
  P2P_LOG(Info, "peer ", hex(p.incarnation), " is gone: ", why.message);
  const PeerFailure f{p, why, state};
  p.mark_failed(why, state);
  fail_waiters_of(f);
  fail_transfers_of(f);
  for (auto& r : routes_) r->peer_failed(p);  // the staged route's jobs report into their transfers
  orphan_ops_of(f);
  for (auto& d : drivers_) forgets_.push_back({d.get(), &p});  // at the rail threads' next turn
  regions_.forget_peer(p.incarnation);
  p.forget();
  end_disconnect_of(f);
}

void Worker::fail_waiters_of(const PeerFailure& f) {
  for (uint64_t id : f.peer.connect_waiters) report(id, f.why);
  f.peer.connect_waiters.clear();
}

void Worker::fail_transfers_of(const PeerFailure& f) {
  std::vector<Transfer*> affected;
  for (auto& [id, t] : transfers_)
    if (t->peer == &f.peer && !t->reported()) affected.push_back(t.get());
  for (Transfer* t : affected) {
    if (t->held) t->status = f.why;  // what the check found out is the answer
    fail(*t, f.why);
  }
}

// Posted ops to a dead peer may never complete (shm): their owners hear now and the credits
// return; a completion that still arrives only frees the op.
void Worker::orphan_ops_of(const PeerFailure& f) {
  pool_->for_each_in_use([&](Op& op) {
    if (op.peer != &f.peer || !op.posted || op.orphaned || op.kind == OpKind::Recv) return;
    op.orphaned = true;
    --rails_[op.rail].inflight;
    if (op.region) {
      auto& pin = orphan_pins_[op.region];
      if (!pin.first) pin.first = op.region->shared_from_this();
      ++pin.second;
    }
    OpOwner* owner = op.owner;
    op.owner = nullptr;
    if (owner) owner->op_done(*this, op, f.why);
  });
}

void Peer::forget() {
  partial.clear();
  unacked.clear();
  if (pidfd >= 0) {
    close(pidfd);
    pidfd = -1;
  }
}

// A disconnect under way is done once the peer is dead (a clean leave finishes it itself).
void Worker::end_disconnect_of(const PeerFailure& f) {
  Peer& p = f.peer;
  if (p.disconnect_id && f.state == PeerState::Dead) {
    report(p.disconnect_id, Status{});
    p.disconnect_id = 0;
  }
}

// Something now waits on the peer: a transfer, a job serving it, or a message.
void Worker::begin_work(Peer& p) {
  if (p.busy++ == 0) p.live.watch_from(now());
}

// That work is over; a disconnect() waiting for it goes on.
void Worker::end_work(Peer& p) {
  P2P_ASSERT(p.busy > 0);
  if (--p.busy == 0 && p.disconnect_id) finish_disconnect(p);
}

void Worker::check_peers() {
  const double t = now(), timeout = config_.peer_timeout_s;
  std::vector<std::pair<Peer*, Status>> dead;
  for (auto& [inc, owned] : peers_) {
    Peer& p = *owned;
    const Liveness::Due due = p.live.tick(t, p.busy > 0);
    if (due.send_hello) send_hello(p);
    if (due.verdict == Liveness::Verdict::Unanswered)
      dead.push_back({&p, Status::error(ErrorKind::Peer, cat(describe(p), " did not answer within ",
                                                              timeout, " s (peer_timeout)"))});
    else if (due.verdict == Liveness::Verdict::Silent)
      dead.push_back({&p, Status::error(ErrorKind::Peer, cat(describe(p), " was silent for ", timeout,
                                                              " s (peer_timeout): a check went unanswered"))});
  }
  for (auto& [p, why] : dead) fail_peer(*p, why);
}

// A peer whose memory a same-host route reaches is watched through a pidfd: its exit fails its
// transfers at once, where the fabric would only notice its silence (such routes need nothing
// from the peer's process).
void Worker::watch_process(Peer& p) {
  if (p.pidfd >= 0 || p.address.pid == 0 || p.address.pid == static_cast<uint32_t>(getpid())) return;
#ifdef SYS_pidfd_open
  p.pidfd = static_cast<int>(syscall(SYS_pidfd_open, static_cast<pid_t>(p.address.pid), 0));
  if (p.pidfd < 0) P2P_LOG(Info, "cannot watch the process of peer ", hex(p.incarnation), ": ", std::strerror(errno));
#endif
}

void Worker::check_processes() {
  std::vector<Peer*> exited;
  for (auto& [inc, p] : peers_) {
    if (p->pidfd < 0 || p->failed()) continue;
    pollfd fd{p->pidfd, POLLIN, 0};
    if (::poll(&fd, 1, 0) > 0) exited.push_back(p.get());
  }
  for (Peer* p : exited)
    fail_peer(*p, Status::error(ErrorKind::Peer, cat("peer ", hex(p->incarnation), " is dead: its process (pid ",
                                                     p->address.pid, ") exited")));
}

}  // namespace p2p::engine
