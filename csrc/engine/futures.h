// TorchFutures: the one table of the futures of the operations in flight. An operation's id is
// its slot here (OperationId, operation_id.h), so a call takes a free slot and stores its future
// without hashing or allocating; Python keeps no table of its own.
//
// Each slot holds the torch future and an opaque handle on its Python object (owned by the
// bindings, which alone touch it with the GIL). A success without a result is completed here,
// by the thread that polls completions and without the GIL, so a thread waiting on it wakes at
// once; its handle then waits in `released_` for the bindings to drop it in a batch. Results and
// errors go to Python with their handle, which builds them (bytes, the error classes).
#pragma once

#include <ATen/core/ivalue.h>

#include <cstdint>
#include <mutex>
#include <vector>

#include "common/log.h"
#include "engine/completions.h"
#include "engine/operation_id.h"

namespace p2p::engine {

class TorchFutures {
 public:
  using Future = c10::intrusive_ptr<c10::ivalue::Future>;
  using Handle = void*;  // the Python future, as the bindings keep it

  // Takes a slot for `future`; returns the operation's id (never 0).
  uint64_t add(Future future, Handle handle) {
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.empty()) {
      free_.push_back(static_cast<uint32_t>(slots_.size()));
      slots_.emplace_back();
    }
    const uint32_t index = free_.back();
    free_.pop_back();
    Slot& s = slots_[index];
    s.future = std::move(future);
    s.handle = handle;
    ++in_use_;
    return OperationId::make(s.generation, index);
  }
  // Frees id's slot (its operation did not start); returns its handle, or null.
  Handle drop(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    Slot* s = slot(id);
    return s ? release(*s) : nullptr;
  }
  // The id of the operation in flight that completes `future`; false if none does. A scan:
  // cancel() and stream_wait() are rare next to calls, and the slots in use are few.
  bool find(const Future& future, uint64_t& id) {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < slots_.size(); ++i)
      if (slots_[i].future.get() == future.get()) {
        id = OperationId::make(slots_[i].generation, static_cast<uint32_t>(i));
        return true;
      }
    return false;
  }
  // Completes the future of `c` if it is a success without a result (true: its handle is kept
  // for release()); anything else is for Python with `handle` (false; null if `c` names no
  // future in flight). The slot is free either way.
  bool complete(const Completion& c, Handle& handle) {
    Future f;
    {
      std::lock_guard<std::mutex> lock(mu_);
      Slot* s = slot(c.id);
      if (!s) {
        handle = nullptr;
        return false;
      }
      if (c.status.ok() && c.address.empty()) f = std::move(s->future);
      handle = release(*s);
      if (f) released_.push_back(handle);
    }
    if (!f) return false;
    // Callbacks attached in Python run here; torch takes the GIL for them.
    try {
      if (!f->completed()) f->markCompleted(c10::IValue());
    } catch (const std::exception& e) {
      P2P_LOG(Error, "completing a future failed: ", e.what());
    }
    return true;
  }
  // The handles of futures completed here since the last call, for the bindings to drop.
  void released(std::vector<Handle>& out) {
    std::lock_guard<std::mutex> lock(mu_);
    out.insert(out.end(), released_.begin(), released_.end());
    released_.clear();  // keeps its capacity
  }
  // Every handle still held (in flight or released), the table then empty: at close.
  std::vector<Handle> take_all() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<Handle> out;
    out.swap(released_);
    for (Slot& s : slots_)
      if (s.future) out.push_back(release(s));
    return out;
  }
  size_t in_flight() {
    std::lock_guard<std::mutex> lock(mu_);
    return in_use_;
  }
  // Handles held: futures in flight, and those completed here not yet released.
  size_t held() {
    std::lock_guard<std::mutex> lock(mu_);
    return in_use_ + released_.size();
  }

 private:
  struct Slot {
    Future future;  // null: free
    Handle handle = nullptr;
    uint32_t generation = 1;
  };
  Slot* slot(uint64_t id) {  // under mu_
    const uint32_t index = OperationId::slot(id);
    if (index >= slots_.size()) return nullptr;
    Slot& s = slots_[index];
    return s.future && s.generation == OperationId::generation(id) ? &s : nullptr;
  }
  Handle release(Slot& s) {  // under mu_
    Handle h = s.handle;
    s.future.reset();
    s.handle = nullptr;
    if (++s.generation == 0) s.generation = 1;
    free_.push_back(static_cast<uint32_t>(&s - slots_.data()));
    --in_use_;
    return h;
  }

  std::mutex mu_;
  std::vector<Slot> slots_;
  std::vector<uint32_t> free_;
  std::vector<Handle> released_;  // completed here, handles not yet dropped
  size_t in_use_ = 0;
};

}  // namespace p2p::engine
