// Plain-data operations and the fixed-capacity containers the worker keeps them in.
// The worker allocates nothing per op in steady state: ops come from a pool sized at
// start-up, and queues are rings that only grow when a burst exceeds everything seen before.
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_rma.h>
#include <sys/uio.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "common/error.h"

namespace p2p::core {

struct Op;
class RouteHost;
struct Peer;
struct Region;

// Whoever posted an op hears how it ended: a Transfer (calls and user messages) or a SlotJob.
// Control messages sent for the worker itself (HELLO, acknowledgements) have no owner.
struct OpOwner {
  virtual ~OpOwner() = default;
  virtual void op_done(RouteHost& host, Op& op, const Status& status) = 0;
  // An abandoned owner (failed, timed out) wants its queued ops dropped, not posted.
  virtual bool abandoned() const = 0;
};

// Forget is never posted: it tells a rail thread to drop the ops to `peer` that it holds
// and the provider has not taken yet (the peer failed; their owners heard already).
enum class OpKind : uint8_t { Write, Read, Send, Recv, Forget };

// What an error message calls an op of this kind.
inline const char* op_name(OpKind kind) {
  switch (kind) {
    case OpKind::Write: return "RMA write";
    case OpKind::Read: return "RMA read";
    case OpKind::Send: return "message";
    case OpKind::Recv: return "receive";
    case OpKind::Forget: return "forget";
  }
  return "op";
}

// Segments one op may carry (scatter-gather RMA), where the provider allows as many.
constexpr size_t kMaxIov = 4;

struct Op {
  fi_context2 ctx;  // first member: a completion's op_context is the Op itself
  OpKind kind = OpKind::Write;
  uint16_t rail = 0;         // local rail it is posted on
  uint8_t niov = 0;
  bool posted = false;
  bool orphaned = false;     // its peer was declared dead while it was posted
  bool farewell = false;     // a BYE: posted although its peer is marked Left
  bool hello = false;        // a HELLO: whether it got through decides its peer's fate
  bool device = false;       // local memory is GPU memory (completion semantics differ on shm)
  OpOwner* owner = nullptr;
  Peer* peer = nullptr;
  Region* region = nullptr;  // user memory the local segments lie in, if any (not slots or messages)
  fi_addr_t dest = FI_ADDR_UNSPEC;
  iovec iov[kMaxIov];        // local segments (Send/Recv: the buffer)
  void* desc[kMaxIov];
  fi_rma_iov rma[kMaxIov];   // remote segments, as long as the local ones (Write/Read)
  int32_t buffer = -1;       // control-message buffer (Send, Recv)

  void* local() const { return iov[0].iov_base; }
  void set_buffer(void* buf, size_t len, void* d) {
    iov[0] = {buf, len};
    desc[0] = d;
    niov = 1;
  }
  void add(void* buf, size_t len, void* d, uint64_t remote_addr, uint64_t key) {
    iov[niov] = {buf, len};
    desc[niov] = d;
    rma[niov] = {remote_addr, len, key};
    ++niov;
  }
};

// FIFO with push_front for the lazy-posting requeue on -FI_EAGAIN.
template <typename T>
class Ring {
 public:
  explicit Ring(size_t capacity = 64) : items_(round_up(capacity)) {}
  bool empty() const { return size_ == 0; }
  size_t size() const { return size_; }
  T& front() { return items_[head_]; }
  const T& front() const { return items_[head_]; }
  void pop_front() {
    head_ = (head_ + 1) & (items_.size() - 1);
    --size_;
  }
  void push_back(T value) {
    if (size_ == items_.size()) grow();
    items_[(head_ + size_) & (items_.size() - 1)] = value;
    ++size_;
  }
  void push_front(T value) {
    if (size_ == items_.size()) grow();
    head_ = (head_ + items_.size() - 1) & (items_.size() - 1);
    items_[head_] = value;
    ++size_;
  }
  T& operator[](size_t i) { return items_[(head_ + i) & (items_.size() - 1)]; }

 private:
  static size_t round_up(size_t n) {
    size_t c = 1;
    while (c < n) c <<= 1;
    return c;
  }
  void grow() {
    std::vector<T> bigger(items_.size() * 2);
    for (size_t i = 0; i < size_; ++i) bigger[i] = (*this)[i];
    items_.swap(bigger);
    head_ = 0;
  }
  std::vector<T> items_;
  size_t head_ = 0;
  size_t size_ = 0;
};

// Ops are allocated once; acquire() returns nullptr when all are in use, which is the
// worker's back-pressure: it stops generating until completions return some.
class OpPool {
 public:
  explicit OpPool(size_t capacity) : ops_(new Op[capacity]), capacity_(capacity) {
    free_.reserve(capacity);
    for (size_t i = capacity; i-- > 0;) free_.push_back(&ops_[i]);
  }
  Op* acquire() {
    if (free_.empty()) return nullptr;
    Op* op = free_.back();
    free_.pop_back();
    *op = Op{};
    return op;
  }
  void release(Op* op) { free_.push_back(op); }
  size_t in_use() const { return capacity_ - free_.size(); }
  template <typename F>
  void for_each_in_use(F&& f) {  // slow path only (peer failure)
    std::vector<bool> is_free(capacity_);
    for (Op* op : free_) is_free[op - ops_.get()] = true;
    for (size_t i = 0; i < capacity_; ++i)
      if (!is_free[i]) f(ops_[i]);
  }

 private:
  std::unique_ptr<Op[]> ops_;
  size_t capacity_;
  std::vector<Op*> free_;
};

}  // namespace p2p::core
