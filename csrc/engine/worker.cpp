#include "engine/worker.h"

#include <sys/epoll.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>

#include "common/log.h"
#include "routes/staged/staging.h"

namespace p2p::engine {

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
  wake();
}

void Worker::wake() {
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
  reports_.push_back({id, std::move(status), std::move(payload), std::move(address)});
}

void Worker::hand_over_reports() { completions_->push_all(reports_); }

bool Worker::region_staged(bool cuda) const {
  if (config_.data_path == DataPath::Staged) return true;
  return cuda && !hmem_;
}

// ---------------------------------------------------------------------------------------------
// The loop.

void Worker::run(std::promise<void>& ready) {
  worker_thread_ = std::this_thread::get_id();
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
    for (auto& r : routes_) busy |= r->poll();
    poll_fences();
    busy |= generate();
    busy |= flush_outbox();
    busy |= post_ops();
    const double t = now();
    if (t >= next_tick_) {
      tick();
      next_tick_ = t + 0.005;
    }
    hand_over_reports();
    if (busy || always_spin)
      idle_since_ = t;
    else if ((t - idle_since_) * 1e6 > config_.spin_us)
      idle_wait();
  }
  shutdown();
}

bool Worker::drain_commands() {
  assert_on_worker();
  draining_.clear();  // empty, unless a command threw past the handler below
  {
    std::lock_guard<std::mutex> lock(commands_mu_);
    if (commands_.empty()) return false;
    draining_.swap(commands_);  // the queue keeps the emptied buffer: post() need not allocate
  }
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
    void refuse(uint64_t id) { w.report(id, Status::error(ErrorKind::Closed, "the engine was closed")); }
    void operator()(StartTransfer& c) {
      if (closed) return refuse(c.transfer->id);
      w.start(c.transfer.release());  // the worker owns it from here
    }
    void operator()(Connect& c) { closed ? refuse(c.id) : w.connect(c.id, c.address); }
    void operator()(Disconnect& c) { closed ? refuse(c.id) : w.disconnect(c.id, c.address); }
    void operator()(Receive& c) { closed ? refuse(c.id) : w.recv(c.id, c.timeout_s); }
    void operator()(AwaitNotification& c) { closed ? refuse(c.id) : w.notification(c.id, c.tag, c.timeout_s); }
    void operator()(Cancel& c) {
      if (!closed) w.cancel(c.id);
    }
    void operator()(Call& c) { c.fn(w, closed); }
  };
  std::visit(Run{*this, closed}, command);
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
  for (auto& r : routes_) can_sleep = can_sleep && r->idle();
  // Nothing wakes us when a CUDA copy or the caller's stream event completes: keep polling.
  can_sleep = can_sleep && fences_.empty() &&
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
  for (auto& r : routes_) r->tick();

  regions_.finish(now(), [this](Region& r) { deregister_mrs(r); });
}

// ---------------------------------------------------------------------------------------------
// Shutdown: everything in flight fails with ClosedError; peers hear goodbye.

void Worker::shutdown() {
  const Status closed = Status::error(ErrorKind::Closed, "the engine was closed");
  fail_everything(closed);
  // Out before anything below, which may wait (for a stream, for peers): threads waiting on
  // these futures (stream_wait among them) hear at once.
  hand_over_reports();
  say_goodbye();
  release_registrations();
  close_rails();
  release_held_resources();
  refuse_late_commands();
  hand_over_reports();
  if (epoll_fd_ >= 0) close(epoll_fd_);
  // wake_fd_ stays open until the destructor: post() may still write to it.
}

// Transfers, receives, notifications and connects in flight end with `closed`; disconnects
// succeed.
void Worker::fail_everything(const Status& closed) {
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
  }
}

void Worker::say_goodbye() {
  for (auto& [inc, p] : peers_) {
    // Also to peers that left us, or that we left: alive, they may reconnect (on_bye()).
    if (p->state() == PeerState::Ready || (p->state() == PeerState::Left && !p->closed))
      send_control(*p, bye(*p, true), nullptr, true);
  }
  // Give the goodbyes up to a second to be taken, answering meanwhile what peers sent before
  // they took ours: on shm a command left unanswered stalls its sender's endpoint (on_bye()).
  const double until = now() + 1.0;
  while (now() < until && (!control_.idle() || pool_->in_use() > 0)) {
    flush_outbox();
    post_ops();
    poll_rails();
  }
}

void Worker::release_registrations() {
  orphan_pins_.clear();
  regions_.clear([this](Region& r) { deregister_mrs(r); });
  for (auto& r : routes_) r->stop();  // their copies end; their registrations go before the rails
  control_.close(*rails_[0].rail);
}

void Worker::close_rails() {
  for (auto& d : drivers_) d->drain([](const RailDriver::Event& e) { delete e.message; });
  drivers_.clear();  // joins the rail threads before their rails go
  for (auto& rs : rails_) rs.driver = nullptr;
  rails_.clear();  // closes the endpoints: nothing posted completes after this
}

// What outlives the rails: the routes (their mappings, staging memory), CUDA events
// (transfers' stream events, peers' unanswered fences), process fds.
void Worker::release_held_resources() {
  routes_.clear();
  for (auto& [id, t] : transfers_)
    if (t->cuda_event) copier_->release_event(t->cuda_event);
  transfers_.clear();
  for (auto& [inc, p] : peers_)
    if (p->pidfd >= 0) close(p->pidfd);
  for (const PendingFence& f : fences_)
    if (f.event) copier_->release_event(f.event);
  fences_.clear();
}

// Commands queued after the loop's last turn run with closed=true: they only report failure.
void Worker::refuse_late_commands() {
  std::vector<Command> late;
  {
    std::lock_guard<std::mutex> lock(commands_mu_);
    closed_ = true;
    late.swap(commands_);
  }
  for (auto& command : late) {
    try {
      execute(command, true);
    } catch (const std::exception& e) {
      P2P_LOG(Debug, "a command was dropped at close: ", e.what());
    }
  }
}

}  // namespace p2p::engine
