#include "engine/peers.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/clock.h"
#include "common/log.h"
#include "common/process.h"

namespace p2p::engine {

using namespace core;
namespace {

std::string describe(const Peer& p) { return cat("peer ", hex(p.incarnation)); }

// An op's error that says the connection under it went away (tcp fails what its teardown
// flushed with FI_ECANCELED and a prov_errno that need not name the cause).
bool connection_lost(int err) {
  return err == FI_ENOTCONN || err == EPIPE || err == FI_ECONNRESET || err == FI_ECONNABORTED || err == FI_ECANCELED;
}

// Whether q names `addr` on local rail `rail` (Peer::fi is local-rail-major).
bool names(const Peer& q, size_t rail, fi_addr_t addr) {
  const size_t r = q.remote_rails();
  for (size_t k = rail * r; k < (rail + 1) * r && k < q.fi.size(); ++k)
    if (q.fi[k] == addr) return true;
  return false;
}

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

Peers::~Peers() {
  for (auto& [inc, p] : peers_)
    if (p->pidfd >= 0) ::close(p->pidfd);
}

void Peers::open(Rails& rails, ControlChannel& control, const RegionTable& regions, std::string provider,
                 std::string address, uint64_t incarnation) {
  rails_ = &rails;
  control_ = &control;
  regions_ = &regions;
  provider_ = std::move(provider);
  address_ = std::move(address);
  incarnation_ = incarnation;
}

Peer* Peers::find(uint64_t incarnation) {
  auto it = peers_.find(incarnation);
  return it == peers_.end() ? nullptr : it->second.get();
}

// Finds or creates the peer behind an engine address. A new peer gets its rails inserted in
// every local rail's address vector, then a HELLO; transfers to it wait for the answer.
// An incarnation is one process, at one set of rails. Once it has answered from its rails, an
// address naming it at others is forged or corrupt and is refused. Until then addresses are
// only claims (the first one may have been the forgery): another is tried once the attempt
// under way has failed, or at once when the process itself introduces itself from it. One
// attempt at a time: thousands of addresses of one incarnation at dead ports, each starting a
// HELLO, would keep rail 0's send buffers busy and hold up a real peer's introduction past
// peer_timeout.
Peer* Peers::peer_for(const std::string& address_bytes, Contact how) {
  // Every transfer names its peer by address: the same bytes as the last peer's, of a peer that
  // has not failed, find it without decoding them (which allocates). Peers are never erased.
  if (last_peer_ && !last_peer_->failed() && last_peer_->address_bytes == address_bytes) return last_peer_;
  last_peer_ = find_peer(address_bytes, how);
  return last_peer_;
}

Peer* Peers::find_peer(const std::string& address_bytes, Contact how) {
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
    } else if (p.failed() && !p.closed && (how != Contact::Implicit || !p.left_us)) {
      // A new contact: every call of the old one has failed. Not before the old one's
      // connections are cut and its ops are back (Worker::drain_peer, then drained()).
      if (p.draining())
        p.revive_when_drained = true;
      else
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

void Peers::readdress(Peer& p, EngineAddress a, const std::string& address_bytes) {
  p.fi = rails_->insert(a.rails);
  p.address = std::move(a);
  p.address_bytes = address_bytes;
}

void Peers::revive(Peer& p) {
  p.left_us = false;
  p.live.connect(now());
  p.failure = Status{};
  send_hello(p);
}

void Peers::send_hello(Peer& p) {
  send(p, message(Hello{address_, regions_->live()}, p));
}

// Asks a Ready peer to introduce itself again, after one of our ops to it failed (a refusal
// or a lost connection) or after a silence: the answer says whether it is still there and
// still the same process. A HELLO rather than a ping, since a process that replaced it at
// its address does not know us and can answer only a message that carries our address.
void Peers::check(Peer& p, double deadline) {
  if (p.live.start_check(deadline)) send_hello(p);
}

// A HELLO lost while the connection under it is torn down (tcp;ofi_rxm drops a connection
// whose RMA the owner refused) is sent again after a pause (Liveness::hello_failed); any
// other failure is final. tcp fails what the teardown flushed with FI_ECANCELED and a
// prov_errno that need not name the cause (see classify() in worker.cpp).
void Peers::hello_failed(Peer& p, int err, const Status& status) {
  const bool transient = connection_lost(err);
  const double t = now();
  switch (p.live.hello_failed(t, transient)) {
    case Liveness::Retry::Ignore:
      return;
    case Liveness::Retry::GiveUp:
      return fail(p, status);
    case Liveness::Retry::Later:
      P2P_LOG(Info, "introducing ourselves to ", describe(p), " again in ", p.live.retry_at() - t,
              " s after: ", status.message);
  }
}

void Peers::connect(uint64_t id, const std::string& address) {
  Peer* p;
  try {
    p = peer_for(address, Contact::Connect);
  } catch (const Error& e) {
    return reports_.add(id, Status::error(e.kind(), e.what()));
  }
  if (p->state() == PeerState::Ready) return reports_.add(id, Status{});
  if (p->refuses()) return reports_.add(id, p->failure);  // it closed: that process is gone
  p->connect_waiters.push_back(id);
}

void Peers::disconnect(uint64_t id, const std::string& address) {
  EngineAddress a;
  try {
    a = EngineAddress::decode(address);
  } catch (const Error& e) {
    return reports_.add(id, Status::error(e.kind(), e.what()));
  }
  auto it = peers_.find(a.incarnation);
  if (it == peers_.end() || it->second->failed()) return reports_.add(id, Status{});
  Peer& p = *it->second;
  if (p.disconnect_id) return reports_.add(id, Status::error(ErrorKind::Value, "a disconnect from this peer is already under way"));
  p.disconnect_id = id;
  // A clean leave: what is in flight to the peer finishes first.
  if (p.busy == 0) finish_disconnect(p);
}

void Peers::finish_disconnect(Peer& p) {
  const uint64_t id = p.disconnect_id;
  p.disconnect_id = 0;
  if (p.state() == PeerState::Ready || p.state() == PeerState::Connecting)
    send(p, message(Bye{false}, p), nullptr, true);
  fail(p, Status::error(ErrorKind::Peer, cat(describe(p), " was disconnected by this engine")), PeerState::Left);
  reports_.add(id, Status{});
}

// ---------------------------------------------------------------------------------------------

// The peer leaves us, or closes. A closed peer must never be sent anything again, not even our
// BYE (usable()) or a HELLO to reconnect: shm (libfabric 1.17) stalls every later completion
// of our endpoint behind a command that a closed peer never answers. That happens when a
// disconnect() crosses the peer's close(), or when a write would reconnect to a peer that
// closed after we disconnected from it.
void Peers::on_bye(Peer& p, bool closing) {
  p.closed |= closing;
  p.left_us = !closing;
  const Status left =
      Status::error(ErrorKind::Peer, cat(describe(p), closing ? " left: its engine closed" : " left"));
  if (p.failed())
    p.failure = left;
  else
    fail(p, left, PeerState::Left);
}

// The answer to our HELLO: the peer is there, and still the process we meant, or a new one.
void Peers::on_hello_ack(const MsgHeader& h, const HelloAck& m) {
  EngineAddress a = sender_address(h, m.address);
  auto it = peers_.find(m.expected);
  if (it == peers_.end() || !it->second->waits()) return;
  Peer& p = *it->second;
  if (h.from != m.expected) {
    if (a.rails[0] != p.address.rails[0]) return;  // from an address it no longer has
    p.closed = true;
    return fail(p, Status::error(ErrorKind::Peer,
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
  ready(p);
}

// A HELLO: the sender introduces itself. An older process at the same address is gone.
void Peers::on_hello(const MsgHeader& h, const Hello& m) {
  const EngineAddress a = sender_address(h, m.address);
  for (auto& [inc, q] : peers_) {
    if (inc != a.incarnation && !q->failed() && q->address.rails[0] == a.rails[0]) {
      q->closed = true;
      fail(*q, Status::error(ErrorKind::Peer, cat(describe(*q), " restarted (a new process now "
                                                           "answers at its address)")));
    }
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
  send(*p, message(HelloAck{address_, h.to, regions_->live()}, *p));
  if (p->waits()) ready(*p);
}

// The peer answered as itself: what waited on that goes on.
void Peers::ready(Peer& p) {
  p.live.answered();
  p.confirmed = true;
  for (uint64_t id : p.connect_waiters) reports_.add(id, Status{});
  p.connect_waiters.clear();
  events_.peer_ready(p);
}

// A peer's failure is one event that each part keeping something of the peer reacts to, in this
// order: the peer's record (failed from now on), its connects, then the worker's parts
// (PeerEvents::peer_failed: transfers, the routes' work, posted ops, rail threads, the region
// table's pending releases), then the record's messages and process watch, and last a
// disconnect that a death completes.
void Peers::fail(Peer& p, Status why, PeerState state) {
  if (p.failed()) return;
  P2P_LOG(Info, "peer ", hex(p.incarnation), " is gone: ", why.message);
  const PeerFailure f{p, why, state};
  p.mark_failed(why, state);
  for (uint64_t id : p.connect_waiters) reports_.add(id, why);
  p.connect_waiters.clear();
  events_.peer_failed(f);
  p.forget();
  // A disconnect under way is done once the peer is dead (a clean leave finishes it itself).
  if (p.disconnect_id && state == PeerState::Dead) {
    reports_.add(p.disconnect_id, Status{});
    p.disconnect_id = 0;
  }
}

// One of our ops to p failed. That does not say whether p is gone: the owner may have refused an
// RMA (and tcp;ofi_rxm then drops the connection), or a new process may have taken its address.
// A HELLO finds out (check()); p is dead if that fails or goes unanswered.
void Peers::op_failed(Peer& p, bool hello, int err, const Status& status) {
  if (p.failed()) return;  // its ops come back as its connections are cut
  if (hello) return hello_failed(p, err, status);
  // NOTE: a connection lost under an op (tcp's teardown flushes with FI_ECANCELED) was closed
  // by the peer's kernel: its process died, closed or restarted, or its provider refused an RMA.
  // A live owner answers the check in milliseconds; a dead one's address refuses connections,
  // which ofi_rxm retries unseen. So such a check is given kLostConnectionCheckS, not
  // peer_timeout: a killed peer on another host is dead in a second, not after its silence.
  const bool lost = connection_lost(err) || err == FI_ECONNREFUSED;
  check(p, now() + (lost ? std::min(config_.peer_timeout_s, kLostConnectionCheckS) : config_.peer_timeout_s));
}

void Peers::cut(Peer& p) {
  const size_t remote = p.remote_rails();
  for (size_t i = 0; i < p.fi.size(); ++i) {
    const size_t rail = i / remote;
    const fi_addr_t old = p.fi[i];
    // An address a live peer answers from now (a process restarted there) leads to that process:
    // its connection is not p's to cut, and p's process is gone.
    bool shared = false;
    for (auto& [inc, q] : peers_) shared |= q.get() != &p && !q->failed() && names(*q, rail, old);
    if (shared) continue;
    const fi_addr_t fresh = rails_->rail(rail).cut(old);
    if (fresh == old) continue;
    for (auto& [inc, q] : peers_) {
      const size_t r = q->remote_rails();
      for (size_t k = rail * r; k < (rail + 1) * r && k < q->fi.size(); ++k)
        if (q->fi[k] == old) q->fi[k] = fresh;
    }
  }
}

void Peers::drained(Peer& p) {
  p.drain_until = 0;
  if (!p.revive_when_drained) return;
  p.revive_when_drained = false;
  revive(p);
}

void Peers::begin_work(Peer& p) {
  if (p.busy++ == 0) p.live.watch_from(now());
}

void Peers::end_work(Peer& p) {
  P2P_ASSERT(p.busy > 0);
  if (--p.busy == 0 && p.disconnect_id) finish_disconnect(p);
}

void Peers::tick() {
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
  for (auto& [p, why] : dead) fail(*p, why);
  check_processes();
}

// NOTE: a same-host route needs nothing from the peer's process, so the fabric would notice
// its exit only by its silence; the pidfd tells at once.
void Peers::watch_process(Peer& p) {
  if (p.pidfd >= 0 || p.process_gone || p.address.pid == 0 || p.address.pid == static_cast<uint32_t>(getpid()))
    return;
  p.pidfd = open_pidfd(static_cast<pid_t>(p.address.pid));
  if (p.pidfd >= 0) return;
  if (errno == ESRCH) p.process_gone = true;  // failed at the next tick (check_processes)
  else P2P_LOG(Info, "cannot watch the process of peer ", hex(p.incarnation), ": ", std::strerror(errno));
}

void Peers::check_processes() {
  std::vector<Peer*> gone;
  for (auto& [inc, p] : peers_) {
    if (p->failed()) continue;
    if (p->process_gone || (p->pidfd >= 0 && p2p::exited(p->pidfd))) gone.push_back(p.get());
  }
  for (Peer* p : gone) {
    p->closed = true;
    fail(*p, Status::error(ErrorKind::Peer, cat("peer ", hex(p->incarnation), " is dead: its process (pid ",
                                                     p->address.pid, ") exited")));
  }
}

// Closing: connects in flight end with `closed`; disconnects succeed.
void Peers::close(const Status& closed) {
  for (auto& [inc, p] : peers_) {
    for (uint64_t id : p->connect_waiters) reports_.add(id, closed);
    p->connect_waiters.clear();
    if (p->disconnect_id) reports_.add(p->disconnect_id, Status{});
    p->disconnect_id = 0;
  }
}

void Peers::say_goodbye() {
  for (auto& [inc, p] : peers_) {
    // Also to peers that left us, or that we left: alive, they may reconnect (on_bye()).
    if (p->state() == PeerState::Ready || (p->state() == PeerState::Left && !p->closed))
      send(*p, message(Bye{true}, *p), nullptr, true);
  }
}

}  // namespace p2p::engine
