// Inbox: user messages (send / recv) and notifications (a write's notice to its receiver) on
// the receiving side: what arrived and no one asked for yet, and who waits for what has not
// arrived (with a deadline, 0 = none). What it hands out goes to the worker's reports.
//
// Thread: the worker's.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/error.h"
#include "core/messages.h"
#include "engine/completions.h"

namespace p2p::engine {

using namespace core;

class Inbox {
 public:
  explicit Inbox(Reports& reports) : reports_(reports) {}

  // A whole message from `from` (an engine address).
  void deliver(const std::string& from, std::string payload);
  void recv(uint64_t id, double deadline);
  void notified(const Notify& m);
  void await(uint64_t id, uint32_t tag, double deadline);
  // Ends waiter `id` with CancelledError; false if it waits for nothing here.
  bool cancel(uint64_t id);
  // Waiters past their deadline end with TimeoutError.
  void expire(double now);
  // Every waiter ends with `closed`.
  void close(const Status& closed);

 private:
  struct Waiter {
    uint64_t id;
    double deadline;  // 0 = none
  };
  struct Notices {
    std::vector<Status> arrived;
    std::vector<Waiter> waiters;
  };
  Reports& reports_;
  std::vector<std::pair<std::string, std::string>> messages_;  // (address, payload) unclaimed
  std::vector<Waiter> receivers_;
  std::unordered_map<uint32_t, Notices> notices_;  // by tag
};

}  // namespace p2p::engine
