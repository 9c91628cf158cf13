// RailDriver: a thread that posts ops to, and reads completions from, a subset of an engine's
// rails, so that providers which move bytes on the posting thread (tcp copies every send
// into the kernel there) scale with rails. The worker keeps every decision: it hands ops over
// through a lock-free single-producer ring and gets completions back through another.
//
// Thread model: submit()/kick()/drain() are called by the worker thread only; everything
// else runs on the driver's thread. Only used with thread-safe domains (FI_THREAD_SAFE),
// since the worker still registers memory and inserts addresses on them.
#pragma once

#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/ops.h"
#include "fabric/rail.h"

namespace p2p::core {

// Posts one op on its rail, as the worker and the rail threads both do. -FI_EAGAIN: nothing
// was posted, try again later.
inline ssize_t post_op(fabric::Rail& rail, Op& op, uint64_t flags) {
  switch (op.kind) {
    case OpKind::Write:
      return rail.write(op.iov, op.desc, op.niov, op.dest, op.rma, &op.ctx, flags, op.device);
    case OpKind::Read:
      return rail.read(op.iov, op.desc, op.niov, op.dest, op.rma, &op.ctx, flags);
    case OpKind::Send:
      return rail.send(op.iov[0].iov_base, op.iov[0].iov_len, op.desc[0], op.dest, &op.ctx);
    case OpKind::Recv:
      return rail.recv(op.iov[0].iov_base, op.iov[0].iov_len, op.desc[0], &op.ctx);
    case OpKind::Forget:
      break;
  }
  return -FI_EINVAL;
}

// Posts ops from the front of `queue`, at most `budget`, FI_MORE on all but the last (lazy
// posting). An op refused with -FI_EAGAIN stays queued, and so do the later ops to its
// destination, in order; ops to other destinations go on, so a peer that stops taking data
// (its connection is full) does not stall the others. `usable(op)` may take an op out
// instead (false), also one queued behind a refused op (an abandoned call's op behind a
// message to a stopped peer); `done(op, rc)` hears of each op that left the queue, rc 0 (posted) or a
// libfabric error.
template <typename Usable, typename Done>
void post_queue(fabric::Rail& rail, Ring<Op*>& queue, size_t budget, Usable&& usable, Done&& done) {
  constexpr size_t kMaxRefused = 8;   // more refusing destinations: the rail itself is full
  constexpr size_t kMaxKept = 256;    // ops looked at past refused ones, per call
  fi_addr_t refused[kMaxRefused];
  Op* kept[kMaxKept];
  size_t posted = 0, nrefused = 0, nkept = 0;
  while (posted < budget && !queue.empty() && nkept < kMaxKept) {
    Op* op = queue.front();
    queue.pop_front();
    if (!usable(*op)) continue;  // also behind a refused op: a call that gave up is told now
    if (std::find(refused, refused + nrefused, op->dest) != refused + nrefused) {
      kept[nkept++] = op;
      continue;
    }
    const bool more = posted + 1 < budget && !queue.empty();
    const ssize_t rc = post_op(rail, *op, more ? FI_MORE : 0);
    if (rc != -FI_EAGAIN) {
      ++posted;
      done(*op, rc);
      continue;
    }
    kept[nkept++] = op;
    if (nrefused == kMaxRefused) break;
    refused[nrefused++] = op->dest;
  }
  while (nkept > 0) queue.push_front(kept[--nkept]);
}

// One turn of a polling loop that found nothing to do: offers the core to any thread waiting
// for it, and returns at once when none is.
// NOTE: a thread that polls without yielding holds a core that the threads it waits for need.
// On two cores beside a tcp peer, the peer's rail thread sat runnable for 2.4 ms behind our
// polling rail thread (the other core idle), and the first 4 KiB write after engine.warm()
// took 2-3 ms instead of 0.3 (benchmarks/bw.py --first-contact); beside compiler jobs, every
// write did.
void spin_politely();

// Sleeps until wake_fd (an eventfd) or a descriptor in epoll_fd is ready, for at most
// timeout_ms; with epoll_fd < 0 (rails without wait objects) a 50 us nap, which keeps a
// waiting peer responsive without a full core. Then empties wake_fd.
void doze(int epoll_fd, int wake_fd, int timeout_ms);

// Fixed-capacity lock-free queue for exactly one producer thread and one consumer thread.
template <typename T>
class SpscRing {
 public:
  explicit SpscRing(size_t capacity) {
    size_t c = 1;
    while (c < capacity) c <<= 1;
    items_.resize(c);
  }
  bool push(const T& v) {
    const size_t t = tail_.load(std::memory_order_relaxed);
    if (t - head_.load(std::memory_order_acquire) == items_.size()) return false;
    items_[t & (items_.size() - 1)] = v;
    tail_.store(t + 1, std::memory_order_release);
    return true;
  }
  bool empty() const {
    return head_.load(std::memory_order_acquire) == tail_.load(std::memory_order_acquire);
  }
  bool pop(T& v) {
    const size_t h = head_.load(std::memory_order_relaxed);
    if (h == tail_.load(std::memory_order_acquire)) return false;
    v = items_[h & (items_.size() - 1)];
    head_.store(h + 1, std::memory_order_release);
    return true;
  }

 private:
  std::vector<T> items_;
  alignas(64) std::atomic<size_t> head_{0};
  alignas(64) std::atomic<size_t> tail_{0};
};

class RailDriver {
 public:
  // What came back for an op: its completion, or (error != 0) its failure.
  struct Event {
    Op* op;
    int error;       // positive libfabric error number, 0 on success
    int prov_errno;
    size_t len;      // received bytes (Recv)
    std::string* message;  // owned by the receiver of the event when error != 0
  };

  // rails: the engine's rails, indexed like Op::rail; `mine` the indices this driver owns.
  // cpus: the cores the driver may run on (the process's own set: a driver must not inherit
  // the pinned worker's single core). name: the thread's name, for tools like top -H. An idle
  // driver (no op out) polls for spin_us, then sleeps until kick() or a completion. stall_s:
  // a gap between two turns longer than this (the process was stopped, or starved) drops what
  // is queued here unposted, since the peers may have given up on this process meanwhile.
  RailDriver(const std::vector<fabric::Rail*>& rails, std::vector<uint16_t> mine, size_t capacity,
             size_t batch, int spin_us, double stall_s, int main_wake_fd, std::atomic<bool>* main_sleeping,
             const cpu_set_t& cpus, const std::string& name);
  ~RailDriver();
  RailDriver(const RailDriver&) = delete;
  RailDriver& operator=(const RailDriver&) = delete;

  bool submit(Op* op) { return in_.push(op); }
  void kick();  // after submits: wakes the driver if it sleeps
  bool has_events() const { return !out_.empty(); }
  template <typename F>
  bool drain(F&& f) {
    Event e;
    bool any = false;
    while (out_.pop(e)) {
      f(e);
      any = true;
    }
    return any;
  }

 private:
  void run();
  bool take(Op* op);
  void drop_pending(double stalled_s);
  bool post_pending();
  bool poll();
  void emit(const Event& e);
  void idle();

  std::vector<fabric::Rail*> rails_;  // by global rail index; nullptr where not ours
  std::vector<uint16_t> mine_;
  std::vector<Ring<Op*>> pending_;    // by global rail index: taken but not yet accepted
  SpscRing<Op*> in_;
  SpscRing<Event> out_;
  size_t batch_;
  int spin_us_;
  double stall_s_;
  int main_wake_fd_;
  std::atomic<bool>* main_sleeping_;
  int wake_fd_ = -1, epoll_fd_ = -1;
  size_t outstanding_ = 0;  // ops other than receives, posted and not yet completed
  std::atomic<bool> sleeping_{false};
  std::atomic<bool> stop_{false};
  cpu_set_t cpus_;
  std::string name_;
  std::thread thread_;
};

}  // namespace p2p::core
