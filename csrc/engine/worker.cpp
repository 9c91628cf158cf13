#include "engine/worker.h"

#include <pthread.h>
#include <rdma/fi_errno.h>
#include <sched.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/clock.h"
#include "common/log.h"
#include "core/host.h"
#include "cuda/copier.h"
#include "routes/registry.h"

namespace p2p::engine {

using namespace core;
namespace {

// Moves the calling thread onto the configured core's NUMA node (config.node_cpus), where the
// rails, libfabric's memory and CUDA's will then land; returns the node's cores.
cpu_set_t move_to_node(const Config& config) {
  cpu_set_t process_cpus, node_cpus;
  sched_getaffinity(0, sizeof process_cpus, &process_cpus);
  node_cpus = process_cpus;
  if (config.cpu >= 0 && !config.node_cpus.empty()) {
    CPU_ZERO(&node_cpus);
    for (int c : config.node_cpus)
      if (c >= 0 && c < CPU_SETSIZE && CPU_ISSET(c, &process_cpus)) CPU_SET(c, &node_cpus);
    if (!CPU_ISSET(config.cpu, &node_cpus)) node_cpus = process_cpus;
  }
  if (config.cpu >= 0) pthread_setaffinity_np(pthread_self(), sizeof node_cpus, &node_cpus);
  return node_cpus;
}

void pin_to_core(int cpu) {
  if (cpu < 0) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  if (const int rc = pthread_setaffinity_np(pthread_self(), sizeof set, &set))
    P2P_LOG(Warn, "could not pin the progress thread to cpu ", cpu, ": ", std::strerror(rc));
}

bool is_connection_errno(int err) {
  switch (err) {
    case FI_ECONNREFUSED:
    case FI_ECONNRESET:
    case FI_ECONNABORTED:
    case FI_ENOTCONN:
    case FI_EHOSTUNREACH:
    case FI_ETIMEDOUT:
    case EPIPE:
      return true;
    default:
      return false;
  }
}

// What a failed op says about its peer. Providers report a refused key or range in different
// ways, so only connection errors count as the peer's; the rest is the owner refusing the
// access. Either way the caller hears only after a check of the peer (Peers::op_failed): a
// peer that does not answer is dead, whatever the op said.
// NOTE: tcp (libfabric 1.17, tcpx_ep_disable) refuses an RMA by dropping the connection and
// fails what was in flight on it with FI_ECANCELED and a prov_errno read from errno after its
// own shutdown(): ENOTCONN when the owner's reset came first, else whatever errno held. So
// FI_ECANCELED says nothing of the peer: it is the refusal of an owner that answers the check.
ErrorKind classify(int err) {
  if (is_connection_errno(err)) return ErrorKind::Peer;
  if (err == FI_ECANCELED) return ErrorKind::Remote;
  if (err == FI_EACCES || err == FI_EINVAL || err == FI_ENOKEY || err == FI_EKEYREJECTED || err == FI_EPERM)
    return ErrorKind::Remote;
  return ErrorKind::Generic;
}

// The host copier, or in a CUDA build the CUDA one.
std::unique_ptr<Copier> make_copier(int cuda_device) {
  if (cuda_device < 0) return make_host_copier();
#ifdef WITH_CUDA
  return cuda::make_copier(cuda_device);
#else
  P2P_THROW(ErrorKind::Value, "torch_p2p was built without CUDA; rebuild with CUDA to use cuda:", cuda_device);
#endif
}

}  // namespace

Worker::Worker(Setup setup, CompletionQueue* completions, TransferPool* transfers)
    : config_(std::move(setup.config)), offer_(std::move(setup.offer)), completions_(completions), finished_(transfers) {
  std::promise<void> ready;
  auto opened = ready.get_future();
  thread_ = std::thread([this, &ready] { run(ready); });
  try {
    opened.get();
  } catch (...) {
    thread_.join();
    throw;
  }
}

Worker::~Worker() { stop(); }

void Worker::stop() {
  if (!thread_.joinable()) return;
  stopping_.store(true);
  mailbox_.ring();
  thread_.join();
}

// ---------------------------------------------------------------------------------------------
// Start-up, as named steps. Everything opens on the worker core's NUMA node, so that libfabric's
// and CUDA's memory lands there, and only then is the worker narrowed to its core. NOTE: threads
// inherit their creator's affinity: providers' own threads (tcp runs one per rail) and the rail
// threads, created meanwhile, get the node, not one core.

void Worker::open() {
  const cpu_set_t node_cpus = move_to_node(config_);
  copier_ = make_copier(config_.cuda_device);
  facts_.host = host_identity();
  routes_ = routes::make_routes(*this, config_, facts_.host);
  const fabric::Offer& offer = *offer_;
  facts_.provider = offer.provider;
  facts_.hmem = offer.hmem;
  facts_.dmabuf = offer.list && fabric::limits(*offer.list).dmabuf;
  facts_.delivery_complete = offer.delivery_complete;
  facts_.auto_progress = offer.auto_progress;
  P2P_CHECK(!(config_.cuda() && config_.data_path == DataPath::Direct && !facts_.hmem), ErrorKind::Value,
            "data_path='direct' needs a provider with FI_HMEM (GPUDirect RDMA), but ", facts_.provider,
            " here has none; use data_path='staged' or None");
  rails_ = std::make_unique<Rails>(config_, offer, node_cpus, mailbox_.wake_fd(), mailbox_.sleeping());
  facts_.rails = rails_->facts();
  if (config_.cuda_device >= 0 && facts_.hmem && config_.data_path == DataPath::Auto) probe_hmem();
  for (auto& r : routes_) facts_.off_nics |= r->keeps_off_nics(config_.cuda_device);

  while (facts_.incarnation == 0) (void)!getrandom(&facts_.incarnation, sizeof facts_.incarnation, 0);
  EngineAddress me{facts_.provider, facts_.incarnation, {}, facts_.host, static_cast<uint32_t>(getpid())};
  for (size_t i = 0; i < rails_->size(); ++i) me.rails.push_back(rails_->rail(i).address());
  for (size_t i = 0; i < routes_.size(); ++i) me.routes |= routes_[i]->advertised() << i;
  facts_.address = me.encode();
  peers_.open(*rails_, control_, regions_, facts_.provider, facts_.address, facts_.incarnation);

  // Control messages use rail 0 only: receive buffers, then send buffers.
  control_.open(rails_->rail(0), config_.recv_buffers, config_.send_buffers);
  for (Op& op : control_.receive_ops()) rails_->post_receive(&op, *this);
  for (int fd : rails_->wait_fds()) mailbox_.watch(fd);
  pthread_setname_np(pthread_self(), "p2p-worker");
  pin_to_core(config_.cpu);
}

// Some builds grant FI_HMEM and then refuse CUDA memory (Ubuntu's libfabric 1.17 shm). Trying one
// small registration decides the automatic data path honestly, before any user memory.
void Worker::probe_hmem() {
  void* probe = copier_->alloc_device(1 << 16);
  try {
    fabric::MrHandle mr = rails_->rail(0).register_memory(probe, 1 << 16, FI_READ | FI_WRITE, config_.cuda_device);
    rails_->rail(0).deregister(mr);
  } catch (const Error& e) {
    facts_.hmem = false;
    P2P_LOG(Warn, "provider ", facts_.provider, " offers FI_HMEM but cannot register CUDA memory here (", e.what(),
            "); GPU memory takes the staged path");
  }
  copier_->free_device(probe);
}

// ---------------------------------------------------------------------------------------------
// The loop.

void Worker::run(std::promise<void>& ready) {
  worker_thread_ = std::this_thread::get_id();
  try {
    open();
  } catch (...) {
    rails_.reset();
    ready.set_exception(std::current_exception());
    return;
  }
  ready.set_value();
  // NOTE: a pinned worker owns its core and busy-polls; an unpinned one
  // (host engines, CI) spins for spin_us after the last event and then sleeps.
  const bool always_spin = config_.spin_us < 0;
  idle_since_ = now();
  while (!stopping_.load(std::memory_order_relaxed)) {
    bool busy = drain_commands();
    busy |= rails_->poll(*this);
    for (auto& r : routes_) busy |= r->poll();
    busy |= control_.flush(*rails_);
    busy |= rails_->post(*this);
    const double t = now();
    if (t >= next_tick_) {
      tick();
      next_tick_ = t + 0.005;
    }
    reports_.hand_over(*completions_);
    if (busy || always_spin)
      idle_since_ = t;
    else if ((t - idle_since_) * 1e6 > config_.spin_us)
      idle_wait();
    if (!busy) spin_politely();
  }
  shutdown();
}

bool Worker::drain_commands() {
  assert_on_worker();
  draining_.clear();  // empty, unless a command threw past the handler below
  if (!mailbox_.take(draining_)) return false;
  for (auto& command : draining_) {
    try {
      execute(command, false);
    } catch (const std::exception& e) {
      P2P_LOG(Error, "a command failed on the worker: ", e.what());
    }
  }
  draining_.clear();
  return true;
}

void Worker::execute(Command& command, bool closed) {
  struct Run {
    Worker& w;
    bool closed;
    static double at(double timeout_s) { return timeout_s > 0 ? now() + timeout_s : 0; }
    void refuse(uint64_t id) { w.reports_.add(id, Status::error(ErrorKind::Closed, "the engine was closed")); }
    void operator()(StartTransfer& c) {
      if (closed) return refuse(c.transfer->id);
      w.start(c.transfer.release());  // the worker owns it from here
    }
    void operator()(Connect& c) { closed ? refuse(c.id) : w.peers_.connect(c.id, c.address); }
    void operator()(Disconnect& c) { closed ? refuse(c.id) : w.peers_.disconnect(c.id, c.address); }
    void operator()(Receive& c) { closed ? refuse(c.id) : w.inbox_.recv(c.id, at(c.timeout_s)); }
    void operator()(AwaitNotification& c) { closed ? refuse(c.id) : w.inbox_.await(c.id, c.tag, at(c.timeout_s)); }
    void operator()(Cancel& c) {
      if (!closed) w.cancel(c.id);
    }
    void operator()(Call& c) { c.fn(w, closed); }
  };
  std::visit(Run{*this, closed}, command);
}

void Worker::idle_wait() {
  const bool fds = rails_->all_wait_fds();
  const int timeout_ms = std::clamp(static_cast<int>((next_tick_ - now()) * 1000) + 1, 1, 10);
  mailbox_.sleep(fds, timeout_ms, [&] {
    if (stopping_.load() || rails_->events_waiting()) return false;
    for (auto& r : routes_)
      if (!r->idle()) return false;
    // With wait fds, sleep only if no rail has events pending (trywait); without, nap.
    return !fds || rails_->trywait();
  });
}

// ---------------------------------------------------------------------------------------------
// How ops end (OpSink).

void Worker::completed(Op* op, size_t len) {
  if (!op) return;
  if (op->kind == OpKind::Forget) {
    Peer* p = op->peer;
    rails_->pool().release(op);
    if (p && p->forgets_out > 0 && --p->forgets_out == 0 && p->failed()) peers_.cut(*p);
    return;
  }
  if (op->kind == OpKind::Recv) {
    on_message(static_cast<const char*>(op->local()), len);
    rails_->post_receive(op, *this);
    return;
  }
  complete(op, Status{});
}

void Worker::failed(Op* op, int err, int prov_errno, const std::string& message) {
  if (op->kind == OpKind::Recv) {
    if (stopping_.load()) return;
    P2P_LOG(Warn, "a control message was not received: ", message);
    rails_->post_receive(op, *this);
    return;
  }
  Peer* peer = op->peer;
  std::string who = peer ? cat(" to peer ", hex(peer->incarnation)) : std::string();
  Status status = Status::error(classify(err), cat(op_name(op->kind), who, " failed: ", message));
  P2P_LOG(Debug, status.message, " (", fi_error_name(err), ")");
  const bool hello = op->hello, orphaned = op->orphaned;
  complete(op, status);
  if (peer && !orphaned && !stopping_.load()) peers_.op_failed(*peer, hello, err, status);
}

void Worker::complete(Op* op, const Status& status) {
  control_.release(*op);
  if (op->orphaned) {  // its owner heard already, when the peer was declared dead
    if (op->region) {
      auto pin = orphan_pins_.find(op->region);
      if (--pin->second.second == 0) orphan_pins_.erase(pin);
    }
    rails_->pool().release(op);
    return;
  }
  if (op->posted) rails_->uncount(*op);
  if (status.ok() && op->peer) op->peer->live.heard(now());
  if (OpOwner* owner = op->owner) owner->op_done(*this, *op, status);
  rails_->pool().release(op);
}

bool Worker::usable(Op* op) {
  if (op->peer && op->peer->failed() && (!op->farewell || op->peer->closed)) {
    complete(op, op->peer->failure);
    return false;
  }
  if (op->owner && op->owner->abandoned()) {
    complete(op, Status::error(ErrorKind::Cancelled, "abandoned"));
    return false;
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// Control messages: hellos come first (they introduce a sender we may not know yet), then what
// is meant for this process from a known peer; a goodbye is taken even from a failed peer.

void Worker::send(Peer& p, uint8_t route, std::string body) { peers_.send(p, peers_.message(RouteMessage{route, body}, p)); }

void Worker::on_message(const char* data, size_t len) {
  try {
    Received m = decode_message(std::string_view(data, len));
    const MsgHeader& h = m.header;
    if (const auto* hello = std::get_if<Hello>(&m.body)) return peers_.on_hello(h, *hello);
    if (const auto* ack = std::get_if<HelloAck>(&m.body)) return peers_.on_hello_ack(h, *ack);
    if (h.to != facts_.incarnation) return;  // meant for an earlier process at this address: its
                                             // sender finds out by a check
    Peer* from = peers_.find(h.from);
    if (!from) return;  // never introduced: drop
    Peer& p = *from;
    if (const auto* bye = std::get_if<Bye>(&m.body)) return peers_.on_bye(p, bye->closing);
    if (p.failed()) return;
    p.live.heard(now());
    struct Dispatch {
      Worker& w;
      Peer& p;
      void operator()(const UserFragment& m) { w.on_user(p, m); }
      void operator()(const UserAck& m) {
        auto entry = p.unacked.find(m.id);
        if (entry == p.unacked.end()) return;
        const uint64_t transfer = entry->second;
        p.unacked.erase(entry);
        w.acknowledged(p, transfer);
      }
      void operator()(const Notify& m) { w.inbox_.notified(m); }
      void operator()(const RegionClosed& m) { w.on_region_closed(p, m.id); }
      void operator()(const RegionReleased& m) { w.regions_.released(m.id, p.incarnation); }
      void operator()(const RouteMessage& m) {
        if (m.route < w.routes_.size()) w.routes_[m.route]->on_message(p, m.body);
      }
      void operator()(const Hello&) {}  // taken above
      void operator()(const HelloAck&) {}
      void operator()(const Bye&) {}
    };
    std::visit(Dispatch{*this, p}, m.body);
  } catch (const Error& e) {
    P2P_LOG(Warn, "dropped a malformed control message: ", e.what());
  }
}

// A user message's fragment. Fragments arrive in order (send-after-send), so each continues the
// last.
void Worker::on_user(Peer& p, const UserFragment& m) {
  std::string& buf = p.partial[m.id];
  if (m.offset != buf.size() || m.offset + m.part.size() > m.total) {
    p.partial.erase(m.id);
    throw Error(ErrorKind::Value, "invalid control message: message fragment out of order");
  }
  if (buf.empty()) buf.reserve(m.total);
  buf.append(m.part);
  if (buf.size() < m.total) return;
  std::string payload = std::move(buf);
  p.partial.erase(m.id);
  // Acknowledged here, in the step that takes it: a close() that the delivery itself triggers
  // (a recv callback) comes later and sends this first.
  peers_.send(p, peers_.message(UserAck{m.id}, p));
  inbox_.deliver(p.address_bytes, std::move(payload));
}

// ---------------------------------------------------------------------------------------------
// Timers: deadlines, liveness, regions waiting to be deregistered.

void Worker::tick() {
  const double t = now();
  std::vector<Transfer*> late, taken_back;
  transfers_.for_each([&](Transfer& tr) {
    if (!tr.reported() && tr.deadline > 0 && t > tr.deadline) late.push_back(&tr);
    if (tr.take_back_until > 0) taken_back.push_back(&tr);
  });
  for (Transfer* tr : taken_back) let_go(*tr, t);
  for (Transfer* tr : late) {
    const char* what = tr->kind == TransferKind::Write ? "write_slices"
                       : tr->kind == TransferKind::Read ? "read_slices" : "send";
    fail(*tr, Status::error(ErrorKind::Timeout,
                            cat(what, " to peer ", hex(tr->peer ? tr->peer->incarnation : 0), " timed out after ", tr->timeout_s, " s")));
  }
  inbox_.expire(t);
  peers_.tick();
  peers_.each([&](Peer& p) {
    if (p.draining()) drain_peer(p, t);
  });
  for (auto& r : routes_) r->tick();
  regions_.finish(now(), [this](Region& r) { rails_->deregister(r.mrs); });
}

// ---------------------------------------------------------------------------------------------
// Shutdown: everything in flight fails with ClosedError; peers hear goodbye.

void Worker::shutdown() {
  const Status closed = Status::error(ErrorKind::Closed, "the engine was closed");
  fail_everything(closed);
  // Out before anything below, which may wait (for a stream, for peers): threads waiting on
  // these futures (stream_wait among them) hear at once.
  reports_.hand_over(*completions_);
  say_goodbye();
  release_registrations();
  rails_->close();  // nothing posted completes after this
  release_held_resources();
  // Commands queued after the loop's last turn only report failure.
  for (auto& command : mailbox_.close()) {
    try {
      execute(command, true);
    } catch (const std::exception& e) {
      P2P_LOG(Debug, "a command was dropped at close: ", e.what());
    }
  }
  reports_.hand_over(*completions_);
}

// Transfers, receives, notifications and connects in flight end with `closed`; disconnects
// succeed.
void Worker::fail_everything(const Status& closed) {
  std::vector<Transfer*> live;
  transfers_.for_each([&](Transfer& t) { live.push_back(&t); });
  for (Transfer* t : live) finish(*t, closed);
  inbox_.close(closed);
  peers_.close(closed);
}

void Worker::say_goodbye() {
  peers_.say_goodbye();
  // Give the goodbyes up to a second to be taken, answering meanwhile what peers sent before
  // they took ours: on shm a command left unanswered stalls its sender's endpoint (Peers::on_bye).
  const double until = now() + 1.0;
  while (now() < until && (!control_.idle() || rails_->pool().in_use() > 0)) {
    control_.flush(*rails_);
    rails_->post(*this);
    rails_->poll(*this);
  }
}

void Worker::release_registrations() {
  orphan_pins_.clear();
  regions_.clear([this](Region& r) { rails_->deregister(r.mrs); });
  for (auto& r : routes_) r->stop();  // their copies end; their registrations go before the rails
  control_.close(rails_->rail(0));
}

// What outlives the rails: the routes (their mappings, staging memory), the transfers' CUDA
// events.
void Worker::release_held_resources() {
  routes_.clear();
  transfers_.for_each([&](Transfer& t) {
    if (t.cuda_event) copier_->release_event(t.cuda_event);
    if (t.report_due) reports_.add(t.id, t.status);  // the rails are closed: nothing of it moves
  });
  transfers_.clear();
}

}  // namespace p2p::engine
