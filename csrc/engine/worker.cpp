#include "engine/worker.h"

#include <pthread.h>
#include <rdma/fi_errno.h>
#include <sched.h>
#include <cerrno>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>

#include "common/log.h"
#include "engine/staging.h"

namespace p2p::engine {
namespace {

// The cores of `cpu`'s NUMA node that `allowed` contains (all of `allowed` if unknown).
cpu_set_t node_of(int cpu, const cpu_set_t& allowed) {
  for (int node = 0; node < 1024; ++node) {
    FILE* f = std::fopen(cat("/sys/devices/system/node/node", node, "/cpulist").c_str(), "r");
    if (!f) {
      if (node > 64) break;
      continue;
    }
    char text[4096] = {0};
    const size_t n = std::fread(text, 1, sizeof text - 1, f);
    std::fclose(f);
    text[n] = 0;
    cpu_set_t set;
    CPU_ZERO(&set);
    for (char* part = std::strtok(text, ",\n"); part; part = std::strtok(nullptr, ",\n")) {
      int first = 0, last = 0;
      const int got = std::sscanf(part, "%d-%d", &first, &last);
      if (got < 1) continue;
      if (got == 1) last = first;
      for (int c = first; c <= last && c < CPU_SETSIZE; ++c)
        if (CPU_ISSET(c, &allowed)) CPU_SET(c, &set);
    }
    if (CPU_ISSET(cpu, &set)) return set;
  }
  return allowed;
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
// ways (tcp: FI_ECANCELED with the errno of the cause in prov_errno), so only connection
// errors count as the peer's; the rest is the owner refusing the access.
ErrorKind classify(int err, int prov_errno) {
  if (is_connection_errno(err)) return ErrorKind::Peer;
  if (err == FI_ECANCELED) return is_connection_errno(prov_errno) ? ErrorKind::Peer : ErrorKind::Remote;
  if (err == FI_EACCES || err == FI_EINVAL || err == FI_ENOKEY || err == FI_EKEYREJECTED || err == FI_EPERM)
    return ErrorKind::Remote;
  return ErrorKind::Generic;
}

const char* op_name(OpKind kind) {
  switch (kind) {
    case OpKind::Write: return "RMA write";
    case OpKind::Read: return "RMA read";
    case OpKind::Send: return "message";
    case OpKind::Recv: return "receive";
    case OpKind::Forget: return "forget";
  }
  return "op";
}

}  // namespace

Worker::Worker(WorkerConfig config, CompletionQueue* completions)
    : config_(std::move(config)), completions_(completions) {
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

Worker::~Worker() {
  stop();
  if (wake_fd_ >= 0) close(wake_fd_);
}

void Worker::post(Command command) {
  {
    std::lock_guard<std::mutex> lock(commands_mu_);
    P2P_CHECK(!closed_, ErrorKind::Closed, "the engine is closed");
    commands_.push_back(std::move(command));
  }
  if (sleeping_.load(std::memory_order_acquire)) {
    const uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof one);
  }
}

void Worker::stop() {
  if (!thread_.joinable()) return;
  stopping_.store(true);
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof one);
  thread_.join();
}

double Worker::now() const {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

void Worker::report(uint64_t id, Status status, std::string payload, std::string address) {
  completions_->push({id, std::move(status), std::move(payload), std::move(address)});
}

bool Worker::region_staged(bool cuda) const {
  if (config_.data_path == DataPath::Staged) return true;
  return cuda && !hmem_;
}

// ---------------------------------------------------------------------------------------------
// Start-up: pin, then open the rails, so that libfabric allocates its queues on this core's
// NUMA node.

void Worker::open(std::promise<void>& ready) {
  // Open everything on the worker core's NUMA node, so that libfabric's and CUDA's memory lands
  // there, and only then narrow the worker to its core. NOTE: threads inherit their creator's affinity: providers' own threads (tcp
  // runs one per rail) and the rail drivers, created meanwhile, get the node, not one core.
  sched_getaffinity(0, sizeof process_cpus_, &process_cpus_);
  if (config_.cpu >= 0) {
    node_cpus_ = node_of(config_.cpu, process_cpus_);
    pthread_setaffinity_np(pthread_self(), sizeof node_cpus_, &node_cpus_);
  } else {
    node_cpus_ = process_cpus_;
  }
  copier_ = make_copier(config_.cuda_device);
  open_ipc();
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  P2P_CHECK(wake_fd_ >= 0 && epoll_fd_ >= 0, ErrorKind::Generic, "eventfd/epoll: ", std::strerror(errno));

  const bool cuda = config_.cuda_device >= 0;
  fabric::Offer offer = fabric::query(config_.provider, cuda && config_.data_path != DataPath::Staged);
  provider_ = offer.provider;
  hmem_ = offer.hmem;
  delivery_complete_ = offer.delivery_complete;
  auto_progress_ = offer.auto_progress;
  P2P_CHECK(!(cuda && config_.data_path == DataPath::Direct && !hmem_), ErrorKind::Value,
            "data_path='direct' needs a provider with FI_HMEM (GPUDirect RDMA), but ", provider_,
            " here has none; use data_path='staged' or None");
  P2P_CHECK(!config_.domains.empty(), ErrorKind::Value, "no rails: the domain list is empty");

  size_t total_depth = 0;
  for (size_t i = 0; i < config_.domains.size(); ++i) {
    const std::string& name = config_.domains[i];
    const fi_info* info = offer.domain(name);
    if (!info) {
      std::string offered;
      for (const auto& nic : offer.nics()) offered += (offered.empty() ? "" : ", ") + nic.domain;
      P2P_THROW(ErrorKind::Value, "provider ", provider_, " has no domain '", name,
                "'; it offers: ", offered);
    }
    RailState rs;
    const size_t provider_depth = info->tx_attr->size ? info->tx_attr->size : 1024;
    rs.depth = std::min<size_t>(config_.tx_depth ? config_.tx_depth : 1024, provider_depth);
    const size_t cq_size = 2 * (rs.depth + (i == 0 ? config_.recv_buffers + config_.send_buffers : 0)) + 64;
    const uint16_t port = config_.port ? static_cast<uint16_t>(config_.port + i) : 0;
    rs.rail = std::make_unique<fabric::Rail>(info, cq_size, port);
    rail_facts_.push_back({name, info->fabric_attr->name, rs.depth, rs.rail->wait_fd() >= 0});
    total_depth += rs.depth;
    rails_.push_back(std::move(rs));
  }

  if (cuda && hmem_ && config_.data_path == DataPath::Auto) probe_hmem();

  while (incarnation_ == 0) (void)!getrandom(&incarnation_, sizeof incarnation_, 0);
  EngineAddress me{provider_, incarnation_, {}, host_, static_cast<uint32_t>(getpid()), ipc_ != nullptr};
  for (auto& rs : rails_) me.rails.push_back(rs.rail->address());
  address_ = me.encode();

  start_drivers();

  // Ops for RMA and sends: two per posting credit, so that queues can be filled while the
  // posted half is in flight.
  pool_ = std::make_unique<OpPool>(2 * total_depth + config_.send_buffers);

  // Control messages use rail 0 only: receive buffers, then send buffers.
  const size_t nbuf = config_.recv_buffers + config_.send_buffers;
  control_.assign(nbuf * kMessageBytes, 0);
  fabric::Rail& rail0 = *rails_[0].rail;
  control_mr_.push_back(
      rail0.register_memory(control_.data(), control_.size(), FI_SEND | FI_RECV, -1));
  recv_ops_.resize(config_.recv_buffers);
  for (size_t i = 0; i < config_.recv_buffers; ++i) {
    Op& op = recv_ops_[i];
    op.kind = OpKind::Recv;
    op.buffer = static_cast<int32_t>(i);
    op.set_buffer(control_.data() + i * kMessageBytes, kMessageBytes, control_mr_[0].desc);
    post_receive(&op);
  }
  for (size_t i = config_.recv_buffers; i < nbuf; ++i) free_send_.push_back(static_cast<int32_t>(i));

  epoll_event ev{};
  ev.events = EPOLLIN;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev);
  for (auto& rs : rails_) {
    if (rs.driver || rs.rail->wait_fd() < 0) continue;
    epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, rs.rail->wait_fd(), &ev);
  }
  pthread_setname_np(pthread_self(), "p2p-worker");
  if (config_.cpu >= 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(config_.cpu, &set);
    if (const int rc = pthread_setaffinity_np(pthread_self(), sizeof set, &set))
      P2P_LOG(Warn, "could not pin the progress thread to cpu ", config_.cpu, ": ", std::strerror(rc));
  }
  ready.set_value();
}

// Some builds grant FI_HMEM and then refuse CUDA memory (Ubuntu's libfabric 1.17 shm). Trying one
// small registration decides the automatic data path honestly, before any user memory.
void Worker::probe_hmem() {
  void* probe = copier_->alloc_device(1 << 16);
  try {
    fabric::MrHandle mr = rails_[0].rail->register_memory(probe, 1 << 16, FI_READ | FI_WRITE, config_.cuda_device);
    rails_[0].rail->deregister(mr);
  } catch (const Error& e) {
    hmem_ = false;
    P2P_LOG(Warn, "provider ", provider_, " offers FI_HMEM but cannot register CUDA memory here (", e.what(),
            "); GPU memory takes the staged path");
  }
  copier_->free_device(probe);
}

// NOTE: with one thread posting for every rail, tcp plateaus at about one stream's
// bandwidth (50 Gbps for 1, 2, 4 and 8 rails on the GPU machine, against 232 Gbps for 8
// plain TCP streams): its provider copies each send into the kernel on the posting thread.
// Drivers shard the posting per rail. Only for thread-safe (auto progress) domains.
void Worker::start_drivers() {
  const int wanted = config_.rail_threads < 0 ? (auto_progress_ ? static_cast<int>(rails_.size()) : 0)
                                              : config_.rail_threads;
  if (wanted <= 0) return;
  P2P_CHECK(auto_progress_, ErrorKind::Value, "rail threads need a thread-safe provider (tcp with auto progress)");
  const size_t n = std::min<size_t>(wanted, rails_.size());
  std::vector<fabric::Rail*> rails;
  for (auto& rs : rails_) rails.push_back(rs.rail.get());
  for (size_t d = 0; d < n; ++d) {
    std::vector<uint16_t> mine;
    size_t capacity = config_.recv_buffers + config_.send_buffers;
    for (size_t r = d; r < rails_.size(); r += n) {
      mine.push_back(static_cast<uint16_t>(r));
      capacity += 2 * rails_[r].depth;
    }
    cpu_set_t cpus = node_cpus_;
    if (config_.cpu >= 0 && CPU_COUNT(&cpus) > 1) CPU_CLR(config_.cpu, &cpus);  // the worker's own core
    drivers_.push_back(std::make_unique<RailDriver>(rails, mine, capacity, config_.batch,
                                                    config_.spin_us < 0 ? -1 : 1000, wake_fd_, &sleeping_,
                                                    cpus, cat("p2p-rail", d)));
    for (uint16_t r : mine) rails_[r].driver = drivers_.back().get();
  }
}

void Worker::post_receive(Op* op) {
  if (RailDriver* driver = rails_[0].driver) {
    op->rail = 0;
    if (!driver->submit(op)) P2P_LOG(Error, "could not hand a receive buffer to its rail thread");
    driver->kick();
    return;
  }
  ssize_t rc;
  while ((rc = rails_[0].rail->recv(op->iov[0].iov_base, op->iov[0].iov_len, op->desc[0], &op->ctx)) == -FI_EAGAIN)
    drain_cq(*rails_[0].rail, 1);  // the provider's receive queue is full: take what completed
  if (rc < 0) P2P_LOG(Error, "could not post a receive buffer: ", fi_error_name(-rc));
}

// ---------------------------------------------------------------------------------------------
// The loop.

void Worker::run(std::promise<void>& ready) {
  try {
    open(ready);
  } catch (...) {
    drivers_.clear();
    rails_.clear();
    ready.set_exception(std::current_exception());
    return;
  }
  // NOTE: a pinned worker owns its core and busy-polls; an unpinned one
  // (host engines, CI) spins for spin_us after the last event and then sleeps.
  const bool always_spin = config_.spin_us < 0;
  idle_since_ = now();
  while (!stopping_.load(std::memory_order_relaxed)) {
    bool busy = drain_commands();
    busy |= poll_rails();
    poll_copies();
    busy |= poll_ipc();
    poll_fences();
    busy |= generate();
    busy |= flush_outbox();
    busy |= post_ops();
    const double t = now();
    if (t >= next_tick_) {
      tick();
      next_tick_ = t + 0.005;
    }
    if (busy || always_spin)
      idle_since_ = t;
    else if ((t - idle_since_) * 1e6 > config_.spin_us)
      idle_wait();
  }
  shutdown();
}

bool Worker::drain_commands() {
  std::vector<Command> batch;
  {
    std::lock_guard<std::mutex> lock(commands_mu_);
    if (commands_.empty()) return false;
    batch.swap(commands_);
  }
  for (auto& command : batch) {
    try {
      command(*this, false);
    } catch (const std::exception& e) {
      P2P_LOG(Error, "a command failed on the worker: ", e.what());
    }
  }
  return true;
}

void Worker::idle_wait() {
  sleeping_.store(true, std::memory_order_release);
  bool pending;
  {
    std::lock_guard<std::mutex> lock(commands_mu_);
    pending = !commands_.empty();
  }
  bool can_sleep = !pending && !stopping_.load();
  for (auto& d : drivers_) can_sleep = can_sleep && !d->has_events();
  // Nothing wakes us when a CUDA copy or the caller's stream event completes: keep polling.
  can_sleep = can_sleep && copying_.empty() && fences_.empty() && ipc_copies_.empty() &&
              (gen_queue_.empty() || !gen_queue_.front()->cuda_event);
  bool all_fds = true;
  for (auto& rs : rails_) all_fds &= rs.driver || rs.rail->wait_fd() >= 0;
  // With wait fds, sleep only if no rail has events pending (trywait); without, nap.
  if (can_sleep && all_fds)
    for (auto& rs : rails_) can_sleep = can_sleep && (rs.driver || rs.rail->trywait());
  if (can_sleep)
    doze(all_fds ? epoll_fd_ : -1, wake_fd_, std::clamp(static_cast<int>((next_tick_ - now()) * 1000) + 1, 1, 10));
  sleeping_.store(false, std::memory_order_release);
}

// ---------------------------------------------------------------------------------------------
// Completions.

bool Worker::poll_rails() {
  bool any = false;
  for (auto& d : drivers_) {
    any |= d->drain([&](const RailDriver::Event& e) {
      if (e.error) {
        op_failed(e.op, e.error, e.prov_errno, *e.message);
        delete e.message;
      } else {
        on_completion(e.op, e.len);
      }
    });
  }
  for (auto& rs : rails_)
    if (!rs.driver) any |= drain_cq(*rs.rail, 4);
  return any;
}

bool Worker::drain_cq(fabric::Rail& rail, int rounds) {
  return rail.drain(
      rounds, [&](void* op, size_t len) { on_completion(static_cast<Op*>(op), len); },
      [&](const fi_cq_err_entry& err, const std::string& message) {
        if (!err.op_context) {
          P2P_LOG(Warn, "completion error without an operation: ", message);
          return;
        }
        op_failed(static_cast<Op*>(err.op_context), err.err, err.prov_errno, message);
      });
}

void Worker::on_completion(Op* op, size_t len) {
  if (!op) return;
  if (op->kind == OpKind::Forget) return pool_->release(op);
  if (op->kind == OpKind::Recv) {
    on_message(static_cast<const char*>(op->local()), len);
    post_receive(op);
    return;
  }
  complete_op(op, Status{});
}

void Worker::op_failed(Op* op, int err, int prov_errno, const std::string& message) {
  if (op->kind == OpKind::Recv) {
    if (stopping_.load()) return;
    P2P_LOG(Warn, "a control message was not received: ", message);
    post_receive(op);
    return;
  }
  Peer* peer = op->peer;
  const ErrorKind kind = classify(err, prov_errno);
  std::string who = peer ? cat(" to peer ", hex(peer->incarnation)) : std::string();
  Status status = Status::error(kind, cat(op_name(op->kind), who, " failed: ", message));
  const bool hello = op->hello, orphaned = op->orphaned;
  complete_op(op, status);
  if (!peer || orphaned || stopping_.load()) return;
  // A failed op does not say whether its peer is gone: the owner may have refused an RMA (and
  // tcp;ofi_rxm then drops the connection), or a new process may have taken its address. A
  // HELLO finds out (check()); the peer is dead if that fails or goes unanswered.
  if (hello) return on_hello_failed(*peer, err, prov_errno, status);
  check(*peer, now() + config_.peer_timeout_s);
}

void Worker::complete_op(Op* op, const Status& status) {
  if (op->buffer >= 0) free_send_.push_back(op->buffer);
  if (op->orphaned) {  // its owner heard already, when the peer was declared dead
    if (op->region) {
      auto pin = orphan_pins_.find(op->region);
      if (--pin->second.second == 0) orphan_pins_.erase(pin);
    }
    pool_->release(op);
    return;
  }
  if (op->posted) --rails_[op->rail].inflight;
  if (status.ok() && op->peer) op->peer->live.heard(now());
  OpOwner* owner = op->owner;
  if (owner) owner->op_done(*this, *op, status);
  pool_->release(op);
}

// ---------------------------------------------------------------------------------------------
// Posting: per rail, up to `batch` ops, FI_MORE on all but the last (the doorbell rings on
// the last one); an op refused with -FI_EAGAIN goes back to the front of its queue, and ops to
// other peers pass it (post_queue).
//
// NOTE: a batch never exceeds the rail's free credits (our count of posted ops against its
// tx queue size), so -FI_EAGAIN after FI_MORE posts, which could leave a batch without its
// doorbell until the next post, comes only from a peer whose connection is full;
// TORCH_P2P_POST_BATCH=1 turns batching off.

bool Worker::post_ops() {
  bool any = send_forgets();
  for (auto& rs : rails_) {
    if (rs.driver) {
      any |= hand_over(rs);
      continue;
    }
    const size_t budget = std::min(config_.batch, rs.depth - std::min(rs.depth, rs.inflight));
    post_queue(*rs.rail, rs.pending, budget, [&](Op& op) { return usable(&op); }, [&](Op& op, ssize_t rc) {
      any = true;
      if (rc == 0) {
        op.posted = true;
        ++rs.inflight;
        return;
      }
      std::string who = op.peer ? cat(" to peer ", hex(op.peer->incarnation)) : std::string();
      complete_op(&op, Status::error(ErrorKind::Generic, cat("posting a ", op_name(op.kind), who, " on ",
                                                             rs.rail->domain_name(), " failed: ", fi_error_name(-rc))));
    });
  }
  return any;
}

// False (and the op completed) when it must not be posted: its peer failed or its owner gave up.
bool Worker::usable(Op* op) {
  if (op->peer && op->peer->failed() && (!op->farewell || op->peer->closed)) {
    complete_op(op, op->peer->failure);
    return false;
  }
  if (op->owner && op->owner->abandoned()) {
    complete_op(op, Status::error(ErrorKind::Cancelled, "abandoned"));
    return false;
  }
  return true;
}

// Ops for a driven rail go to its driver, as many as the rail has credits for; not while the
// driver still has to hear that a peer failed (it would drop ops to the peer revived).
bool Worker::hand_over(RailState& rs) {
  for (auto& f : forgets_)
    if (f.first == rs.driver) return false;
  bool any = false;
  while (rs.inflight < rs.depth && !rs.pending.empty()) {
    Op* op = rs.pending.front();
    if (!usable(op)) {
      rs.pending.pop_front();
      continue;
    }
    if (!rs.driver->submit(op)) break;
    rs.pending.pop_front();
    op->posted = true;
    ++rs.inflight;
    any = true;
  }
  if (any) rs.driver->kick();
  return any;
}

// Tells the rail threads about failed peers (Forget markers), in order with the ops handed over.
bool Worker::send_forgets() {
  size_t kept = 0;
  for (auto& [driver, peer] : forgets_) {
    Op* marker = new_op(OpKind::Forget, 0, nullptr, peer);
    if (marker && driver->submit(marker)) {
      driver->kick();
      continue;
    }
    if (marker) pool_->release(marker);
    forgets_[kept++] = {driver, peer};
  }
  const bool any = kept < forgets_.size();
  forgets_.resize(kept);
  return any;
}

Op* Worker::new_op(OpKind kind, uint16_t rail, OpOwner* owner, Peer* peer) {
  Op* op = pool_->acquire();
  if (!op) return nullptr;
  op->kind = kind;
  op->rail = rail;
  op->owner = owner;
  op->peer = peer;
  return op;
}

// ---------------------------------------------------------------------------------------------
// Timers: deadlines, liveness, regions waiting to be deregistered.

void Worker::tick() {
  const double t = now();
  std::vector<Transfer*> late;
  for (auto& [id, tr] : transfers_)
    if (!tr->reported() && tr->deadline > 0 && t > tr->deadline) late.push_back(tr.get());
  for (Transfer* tr : late) {
    const char* what = tr->kind == TransferKind::Write ? "write_slices"
                       : tr->kind == TransferKind::Read ? "read_slices" : "send";
    fail(*tr, Status::error(ErrorKind::Timeout,
                              cat(what, " to peer ", hex(tr->peer ? tr->peer->incarnation : 0), " timed out after ", tr->timeout_s, " s")));
  }

  auto expire = [&](std::vector<Waiter>& waiters, const char* what) {
    for (size_t i = 0; i < waiters.size();) {
      if (waiters[i].deadline > 0 && t > waiters[i].deadline) {
        report(waiters[i].id, Status::error(ErrorKind::Timeout, cat(what, " timed out")));
        waiters.erase(waiters.begin() + i);
      } else {
        ++i;
      }
    }
  };
  expire(recv_waiters_, "recv");
  for (auto& [tag, state] : notify_) expire(state.waiters, "notification");

  check_peers();
  check_processes();
  poke_abandoned_jobs();

  finish_closing();
}

// ---------------------------------------------------------------------------------------------
// Shutdown: everything in flight fails with ClosedError; peers hear goodbye.

void Worker::shutdown() {
  const Status closed = Status::error(ErrorKind::Closed, "the engine was closed");
  std::vector<Transfer*> live;
  for (auto& [id, t] : transfers_) live.push_back(t.get());
  for (Transfer* t : live) finish(*t, closed);
  for (auto& w : recv_waiters_) report(w.id, closed);
  recv_waiters_.clear();
  for (auto& [tag, state] : notify_)
    for (auto& w : state.waiters) report(w.id, closed);
  notify_.clear();
  for (auto& [inc, p] : peers_) {
    for (uint64_t id : p->connect_waiters) report(id, closed);
    p->connect_waiters.clear();
    if (p->disconnect_id) report(p->disconnect_id, Status{});
    p->disconnect_id = 0;
    // Also to peers that left us, or that we left: alive, they may reconnect (on_bye()).
    if (p->state() == PeerState::Ready || (p->state() == PeerState::Left && !p->closed))
      send_control(*p, bye(*p, true), nullptr, true);
  }
  // Give the goodbyes up to a second to be taken, answering meanwhile what peers sent before
  // they took ours: on shm a command left unanswered stalls its sender's endpoint (on_bye()).
  const double until = now() + 1.0;
  while (now() < until && (!outbox_.empty() || pool_->in_use() > 0)) {
    flush_outbox();
    post_ops();
    poll_rails();
  }
  for (auto& c : closing_)
    for (auto& done : c.waiters) done->set_value();
  closing_.clear();
  orphan_pins_.clear();
  for (auto& [id, region] : regions_)
    for (size_t k = 0; k < region->mrs.size(); ++k) rails_[k % rails_.size()].rail->deregister(region->mrs[k]);
  regions_.clear();
  for (auto& slot : slots_)
    for (size_t r = 0; r < slot->mrs.size(); ++r) rails_[r].rail->deregister(slot->mrs[r]);
  if (!control_mr_.empty()) rails_[0].rail->deregister(control_mr_[0]);
  for (auto& d : drivers_) d->drain([](const RailDriver::Event& e) { delete e.message; });
  drivers_.clear();  // joins the rail threads before their rails go
  for (auto& rs : rails_) rs.driver = nullptr;
  rails_.clear();  // closes the endpoints: nothing posted completes after this
  // CUDA events still held: transfers' stream events and peers' unanswered fences.
  for (auto& [id, t] : transfers_)
    if (t->cuda_event) copier_->release_event(t->cuda_event);
  transfers_.clear();
  ipc_copies_.clear();
  ipc_.reset();  // waits for its copies, then unmaps
  for (auto& [inc, p] : peers_)
    if (p->pidfd >= 0) close(p->pidfd);
  for (const PendingFence& f : fences_)
    if (f.event) copier_->release_event(f.event);
  fences_.clear();
  jobs_.clear();
  if (slot_memory_) copier_->free_pinned(slot_memory_);
  slots_.clear();

  std::vector<Command> late;
  {
    std::lock_guard<std::mutex> lock(commands_mu_);
    closed_ = true;
    late.swap(commands_);
  }
  for (auto& command : late) {
    try {
      command(*this, true);
    } catch (const std::exception& e) {
      P2P_LOG(Debug, "a command was dropped at close: ", e.what());
    }
  }
  if (epoll_fd_ >= 0) close(epoll_fd_);
  // wake_fd_ stays open until the destructor: post() may still write to it.
}

}  // namespace p2p::engine
