// Completions travel from the worker to the Python dispatcher thread through this queue;
// only the dispatcher takes the GIL (to complete torch futures), never the worker.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "common/error.h"

namespace p2p::engine {

struct Completion {
  uint64_t id;
  Status status;
  std::string payload;  // recv: the message; otherwise empty
  std::string address;  // recv: the sender's engine address
};

class CompletionQueue;

// What the worker reports in one turn of its loop: handed over together at its end (one wake
// of the dispatcher for all that completed in a turn). Worker thread only.
class Reports {
 public:
  void add(uint64_t id, Status status, std::string payload = {}, std::string address = {}) {
    items_.push_back({id, std::move(status), std::move(payload), std::move(address)});
  }
  void hand_over(CompletionQueue& queue);

 private:
  std::vector<Completion> items_;
};

class CompletionQueue {
 public:
  void push(Completion c) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      items_.push_back(std::move(c));
    }
    cv_.notify_one();
  }
  // Moves every item of `items` in at once (one wake of the dispatcher); leaves it empty.
  void push_all(std::vector<Completion>& items) {
    if (items.empty()) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (items_.empty()) {
        items_.swap(items);
      } else {
        for (Completion& c : items) items_.push_back(std::move(c));
        items.clear();
      }
    }
    cv_.notify_one();
  }
  // Everything queued, waiting up to timeout_ms for the first; empty on timeout or close.
  std::vector<Completion> pop(int timeout_ms) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), [&] { return !items_.empty() || closed_; });
    std::vector<Completion> out;
    out.swap(items_);
    return out;
  }
  void close() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      closed_ = true;
    }
    cv_.notify_all();
  }
  bool closed() {
    std::lock_guard<std::mutex> lock(mu_);
    return closed_ && items_.empty();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Completion> items_;
  bool closed_ = false;
};

inline void Reports::hand_over(CompletionQueue& queue) { queue.push_all(items_); }

}  // namespace p2p::engine
