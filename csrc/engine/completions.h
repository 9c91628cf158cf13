// Completions travel from the worker to the Python dispatcher thread through this queue;
// only the dispatcher takes the GIL (to complete torch futures), never the worker.
#pragma once

#include <atomic>
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

// Spins until done() or spin_us passed: a thread that expects an event within a few us hears
// of it without a sleep and a wake-up.
template <typename Done>
void spin_until(const Done& done, int spin_us) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us);
  while (!done() && std::chrono::steady_clock::now() < until) {
  }
}

class CompletionQueue {
 public:
  // Moves every item of `items` in at once (one wake of the dispatcher); leaves it empty, with
  // the capacity of a buffer the dispatcher emptied: in steady state nothing is allocated.
  void push_all(std::vector<Completion>& items) {
    if (items.empty()) return;
    bool wake;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (items_.empty()) {
        items_.swap(items);
      } else {
        for (Completion& c : items) items_.push_back(std::move(c));
        items.clear();
      }
      ready_.store(true, std::memory_order_release);
      wake = sleeping_;
    }
    if (wake) cv_.notify_one();  // a dispatcher that spins needs no futex wake
  }
  // Swaps everything queued into `out` (empty before; its capacity goes back to the queue),
  // waiting up to timeout_ms for the first: first spinning up to spin_us, so that a dispatcher
  // expecting completions hears of one without a sleep and wake-up of its thread. Returns with
  // `out` empty on timeout or close.
  void pop(std::vector<Completion>& out, int timeout_ms, int spin_us) {
    spin_until([&] { return ready_.load(std::memory_order_acquire); }, spin_us);
    std::unique_lock<std::mutex> lock(mu_);
    sleeping_ = true;
    cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), [&] { return !items_.empty() || closed_; });
    sleeping_ = false;
    out.swap(items_);
    ready_.store(false, std::memory_order_relaxed);
  }
  void close() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      closed_ = true;
      ready_.store(true, std::memory_order_release);
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
  std::atomic<bool> ready_{false};  // items_ or closed_: what the spin watches
  bool sleeping_ = false;           // under mu_: the dispatcher waits on cv_
  bool closed_ = false;
};

inline void Reports::hand_over(CompletionQueue& queue) { queue.push_all(items_); }

}  // namespace p2p::engine
