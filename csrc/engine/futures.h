// TorchFutures: the torch futures of the operations in flight. One that succeeds without a
// result is completed here, by the thread that polls completions and without the GIL, so a
// thread waiting on it wakes at once rather than after the Python dispatcher's turn at the GIL.
// Results and errors still go to Python, which builds them (bytes, the error classes).
#pragma once

#include <ATen/core/ivalue.h>

#include <cstdint>
#include <mutex>
#include <unordered_map>

#include "common/log.h"
#include "engine/completions.h"

namespace p2p::engine {

class TorchFutures {
 public:
  using Future = c10::intrusive_ptr<c10::ivalue::Future>;

  void add(uint64_t id, Future future) {
    std::lock_guard<std::mutex> lock(mu_);
    ids_[future.get()] = id;
    futures_[id] = std::move(future);
  }
  void drop(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    erase(futures_.find(id));
  }
  // The id of the operation in flight that completes `future`; false if none does.
  bool find(const Future& future, uint64_t& id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = ids_.find(future.get());
    if (it == ids_.end()) return false;
    id = it->second;
    return true;
  }
  // Completes the future of `c` if it is a success without a result (true); anything else is
  // for Python, which builds results and errors (false; the future is forgotten here).
  bool complete(const Completion& c) {
    Future f;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = futures_.find(c.id);
      if (it == futures_.end()) return false;
      if (c.status.ok() && c.address.empty()) f = it->second;
      erase(it);
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

 private:
  void erase(std::unordered_map<uint64_t, Future>::iterator it) {  // under mu_
    if (it == futures_.end()) return;
    ids_.erase(it->second.get());
    futures_.erase(it);
  }

  std::mutex mu_;
  std::unordered_map<uint64_t, Future> futures_;
  std::unordered_map<const c10::ivalue::Future*, uint64_t> ids_;  // find()'s index
};

}  // namespace p2p::engine
