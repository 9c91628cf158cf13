#include "core/rail_driver.h"

#include <poll.h>
#include <pthread.h>
#include <rdma/fi_errno.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/log.h"

namespace p2p::core {
namespace {

void wake(int fd) {
  const uint64_t one = 1;
  (void)!write(fd, &one, sizeof one);
}

}  // namespace

RailDriver::RailDriver(const std::vector<fabric::Rail*>& rails, std::vector<uint16_t> mine, size_t capacity,
                       size_t batch, int spin_us, double stall_s, int main_wake_fd, std::atomic<bool>* main_sleeping,
                       const cpu_set_t& cpus, const std::string& name)
    : rails_(rails.size(), nullptr),
      mine_(std::move(mine)),
      pending_(rails.size()),
      in_(capacity),
      out_(capacity),
      batch_(batch),
      spin_us_(spin_us),
      stall_s_(stall_s),
      main_wake_fd_(main_wake_fd),
      main_sleeping_(main_sleeping),
      cpus_(cpus),
      name_(name) {
  for (uint16_t r : mine_) rails_[r] = rails[r];
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  epoll_event ev{};
  ev.events = EPOLLIN;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev);
  for (uint16_t r : mine_)
    if (rails_[r]->wait_fd() >= 0) epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, rails_[r]->wait_fd(), &ev);
  thread_ = std::thread([this] { run(); });
  // NOTE: a thread inherits its creator's affinity, and the worker may be pinned to one core:
  // left alone, every driver of a GPU engine shares it (staged GPU transfers then run at 1.5 Gbps).
  pthread_setaffinity_np(thread_.native_handle(), sizeof cpus_, &cpus_);
  pthread_setname_np(thread_.native_handle(), name_.substr(0, 15).c_str());
}

RailDriver::~RailDriver() {
  stop_.store(true);
  wake(wake_fd_);
  thread_.join();
  close(epoll_fd_);
  close(wake_fd_);
}

void RailDriver::kick() {
  if (sleeping_.load(std::memory_order_acquire)) wake(wake_fd_);
}

void RailDriver::run() {
  double idle_since = now(), last_turn = idle_since;
  while (!stop_.load(std::memory_order_relaxed)) {
    bool busy = false;
    Op* op;
    while (in_.pop(op)) busy |= take(op);
    const double turn = now();
    if (turn - last_turn > stall_s_) drop_pending(turn - last_turn);
    last_turn = turn;
    busy |= post_pending();
    busy |= poll();
    const double t = now();
    // NOTE: completions that the provider's progress thread writes do not always wake a
    // driver sleeping on the CQ's fd (a staged GPU transfer, a chain of dependent round trips,
    // runs at 7 Gbps instead of 45 then): a driver with ops out keeps polling.
    if (busy || outstanding_ > 0)
      idle_since = t;
    else if ((t - idle_since) * 1e6 > spin_us_)
      idle();
    if (!busy) spin_politely();
  }
}

// An op from the worker joins its rail's queue. A Forget marker takes the ops to its peer out
// of every queue here (ops handed over after it, to the peer revived, stay) and goes back.
bool RailDriver::take(Op* op) {
  if (op->kind != OpKind::Forget) {
    pending_[op->rail].push_back(op);
    return true;
  }
  for (uint16_t r : mine_) {
    Ring<Op*>& q = pending_[r];
    for (size_t i = q.size(); i > 0; --i) {
      Op* queued = q.front();
      q.pop_front();
      if (queued->peer == op->peer)
        emit({queued, FI_ECANCELED, 0, 0, new std::string("dropped unposted: the peer failed")});
      else
        q.push_back(queued);
    }
  }
  emit({op, 0, 0, 0, nullptr});
  return true;
}

// NOTE: a process stopped (SIGSTOP, a VM pause) past its peers' timeout comes back to peers
// that declared it dead and cut its connections, but also to connections they did not cut:
// what it queued before it stopped belongs to calls its peers no longer wait for, and posted
// now it would reach their memory on a new connection. It goes back unposted instead; ops the
// provider held already fail on the cut connections.
void RailDriver::drop_pending(double stalled_s) {
  for (uint16_t r : mine_) {
    Ring<Op*>& q = pending_[r];
    for (size_t i = q.size(); i > 0; --i) {
      Op* queued = q.front();
      q.pop_front();
      if (queued->kind == OpKind::Recv) {
        q.push_back(queued);
        continue;
      }
      emit({queued, FI_ECANCELED, 0, 0,
            new std::string(cat("dropped unposted: this process stalled for ", stalled_s, " s, past its peers' patience"))});
    }
  }
}

// The worker's posting, for our rails.
bool RailDriver::post_pending() {
  bool any = false;
  for (uint16_t r : mine_) {
    fabric::Rail& rail = *rails_[r];
    post_queue(rail, pending_[r], batch_, [](Op&) { return true; }, [&](Op& op, ssize_t rc) {
      any = true;
      if (rc == 0 && op.kind != OpKind::Recv) ++outstanding_;
      if (rc < 0)
        emit({&op, static_cast<int>(-rc), 0, 0,
              new std::string(cat("posting on ", rail.domain_name(), " failed: ", fi_error_name(-rc)))});
    });
  }
  return any;
}

bool RailDriver::poll() {
  bool any = false;
  for (uint16_t r : mine_) {
    any |= rails_[r]->drain(
        4,
        [&](void* context, size_t len) {
          Op* op = static_cast<Op*>(context);
          if (op->kind != OpKind::Recv) --outstanding_;
          emit({op, 0, 0, len, nullptr});
        },
        [&](const fi_cq_err_entry& err, std::string& message) {
          if (!err.op_context) return;
          Op* op = static_cast<Op*>(err.op_context);
          if (op->kind != OpKind::Recv) --outstanding_;
          emit({op, err.err, err.prov_errno, 0, new std::string(std::move(message))});
        });
  }
  return any;
}

void RailDriver::emit(const Event& e) {
  // The ring holds more than the ops that can be in flight, so this does not spin in practice.
  while (!out_.push(e)) std::this_thread::yield();
  if (main_sleeping_->load(std::memory_order_acquire)) wake(main_wake_fd_);
}

void RailDriver::idle() {
  sleeping_.store(true, std::memory_order_release);
  bool can_sleep = !stop_.load();
  Op* peek;
  // Nothing may have arrived between the last pop and the flag: check again.
  if (in_.pop(peek)) can_sleep = !take(peek);
  for (uint16_t r : mine_) can_sleep = can_sleep && pending_[r].empty();
  for (uint16_t r : mine_) can_sleep = can_sleep && rails_[r]->wait_fd() >= 0 && rails_[r]->trywait();
  if (!stop_.load()) doze(can_sleep ? epoll_fd_ : -1, wake_fd_, 1);
  sleeping_.store(false, std::memory_order_release);
}

void spin_politely() { sched_yield(); }

void doze(int epoll_fd, int wake_fd, int timeout_ms) {
  if (epoll_fd >= 0) {
    epoll_event events[8];
    epoll_wait(epoll_fd, events, 8, timeout_ms);
  } else {
    pollfd pfd{wake_fd, POLLIN, 0};
    timespec ts{0, 50 * 1000};
    ppoll(&pfd, 1, &ts, nullptr);
  }
  uint64_t drained;
  (void)!read(wake_fd, &drained, sizeof drained);
}

}  // namespace p2p::core
