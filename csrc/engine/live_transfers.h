// LiveTransfers: the transfers the worker owns, found by id. A transfer's id is an OperationId
// (operation_id.h), whose slot indexes a vector here: found without hashing, added and removed
// without allocating once the vector has grown to the calls in flight.
//
// A slot is reused only once its transfer was reported (OperationId's rule, asserted in add()).
// A transfer that outlives its slot (ops still pending) moves to `stale_` and is no longer found
// by id, nor needs to be: a cancel, an acknowledgement or a stream order of a reported transfer
// changes nothing. Owned by the worker thread.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "common/error.h"
#include "core/transfer.h"
#include "engine/operation_id.h"

namespace p2p::engine {

class LiveTransfers {
 public:
  void add(std::unique_ptr<core::Transfer> t) {
    const uint32_t slot = OperationId::slot(t->id);
    if (slot >= by_slot_.size()) by_slot_.resize(slot + 1);
    if (std::unique_ptr<core::Transfer>& old = by_slot_[slot]) {
      P2P_ASSERT(old->reported() && old->id != t->id);
      stale_.push_back(std::move(old));
    }
    by_slot_[slot] = std::move(t);
  }
  core::Transfer* find(uint64_t id) const {
    const uint32_t slot = OperationId::slot(id);
    core::Transfer* t = slot < by_slot_.size() ? by_slot_[slot].get() : nullptr;
    return t && t->id == id ? t : nullptr;
  }
  // Takes `t` out; it must be here (a transfer is removed once, when it is freed).
  std::unique_ptr<core::Transfer> remove(core::Transfer& t) {
    const uint32_t slot = OperationId::slot(t.id);
    if (slot < by_slot_.size() && by_slot_[slot].get() == &t) return std::move(by_slot_[slot]);
    auto it = std::find_if(stale_.begin(), stale_.end(), [&](auto& s) { return s.get() == &t; });
    P2P_ASSERT(it != stale_.end());
    std::unique_ptr<core::Transfer> out = std::move(*it);
    *it = std::move(stale_.back());
    stale_.pop_back();
    return out;
  }
  // Calls fn(Transfer&) for each; fn must not add or remove (collect first, then act).
  template <typename Fn>
  void for_each(const Fn& fn) const {
    for (const auto& t : by_slot_)
      if (t) fn(*t);
    for (const auto& t : stale_) fn(*t);
  }
  template <typename Pred>
  bool any_of(const Pred& pred) const {
    bool found = false;
    for_each([&](core::Transfer& t) { found = found || pred(t); });
    return found;
  }
  void clear() {
    for (auto& t : by_slot_) t.reset();
    stale_.clear();
  }

 private:
  std::vector<std::unique_ptr<core::Transfer>> by_slot_;
  std::vector<std::unique_ptr<core::Transfer>> stale_;  // outlived their slot (reported)
};

}  // namespace p2p::engine
