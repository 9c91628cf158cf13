// LiveTransfers: the transfers the worker owns, found by id. An id's low 32 bits are its
// future's slot in the table of futures (futures.h), so the transfers sit in a vector indexed
// by slot: found without hashing, added and removed without allocating once the vector has grown
// to the calls in flight.
//
// A slot is reused only once its future completed, that is after its transfer was reported. A
// transfer that outlives its slot (ops still pending) moves to `stale_` and is no longer found
// by id, nor needs to be: a cancel, an acknowledgement or a stream order of a reported transfer
// changes nothing.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/transfer.h"

namespace p2p::engine {

class LiveTransfers {
 public:
  void add(std::unique_ptr<core::Transfer> t) {
    const size_t slot = t->id & 0xffffffffu;
    if (slot >= by_slot_.size()) by_slot_.resize(slot + 1);
    if (by_slot_[slot]) stale_.push_back(std::move(by_slot_[slot]));
    by_slot_[slot] = std::move(t);
  }
  core::Transfer* find(uint64_t id) const {
    const size_t slot = id & 0xffffffffu;
    core::Transfer* t = slot < by_slot_.size() ? by_slot_[slot].get() : nullptr;
    return t && t->id == id ? t : nullptr;
  }
  std::unique_ptr<core::Transfer> remove(core::Transfer& t) {
    std::unique_ptr<core::Transfer> out;
    const size_t slot = t.id & 0xffffffffu;
    if (slot < by_slot_.size() && by_slot_[slot].get() == &t) {
      out = std::move(by_slot_[slot]);
    } else {
      auto it = std::find_if(stale_.begin(), stale_.end(), [&](auto& s) { return s.get() == &t; });
      out = std::move(*it);
      *it = std::move(stale_.back());
      stale_.pop_back();
    }
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
