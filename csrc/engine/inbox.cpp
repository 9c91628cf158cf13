#include "engine/inbox.h"

namespace p2p::engine {

using namespace core;

void Inbox::deliver(const std::string& from, std::string payload) {
  if (!receivers_.empty()) {
    const uint64_t waiter = receivers_.front().id;
    receivers_.erase(receivers_.begin());
    return reports_.add(waiter, Status{}, std::move(payload), from);
  }
  messages_.emplace_back(from, std::move(payload));
}

void Inbox::recv(uint64_t id, double deadline) {
  if (!messages_.empty()) {
    auto [address, payload] = std::move(messages_.front());
    messages_.erase(messages_.begin());
    return reports_.add(id, Status{}, std::move(payload), std::move(address));
  }
  receivers_.push_back({id, deadline});
}

void Inbox::notified(const Notify& m) {
  Status status{m.kind, std::string(m.message)};
  if (!status.ok()) status.message = cat("the sender's write failed: ", status.message);
  Notices& n = notices_[m.id];
  if (!n.waiters.empty()) {
    const uint64_t waiter = n.waiters.front().id;
    n.waiters.erase(n.waiters.begin());
    return reports_.add(waiter, std::move(status));
  }
  n.arrived.push_back(std::move(status));
}

void Inbox::await(uint64_t id, uint32_t tag, double deadline) {
  Notices& n = notices_[tag];
  if (!n.arrived.empty()) {
    Status status = std::move(n.arrived.front());
    n.arrived.erase(n.arrived.begin());
    return reports_.add(id, std::move(status));
  }
  n.waiters.push_back({id, deadline});
}

bool Inbox::cancel(uint64_t id) {
  auto drop = [&](std::vector<Waiter>& waiters) {
    for (size_t i = 0; i < waiters.size(); ++i) {
      if (waiters[i].id != id) continue;
      waiters.erase(waiters.begin() + i);
      reports_.add(id, Status::error(ErrorKind::Cancelled, "cancelled"));
      return true;
    }
    return false;
  };
  if (drop(receivers_)) return true;
  for (auto& [tag, n] : notices_)
    if (drop(n.waiters)) return true;
  return false;
}

void Inbox::expire(double now) {
  auto expire = [&](std::vector<Waiter>& waiters, const char* what) {
    for (size_t i = 0; i < waiters.size();) {
      if (waiters[i].deadline > 0 && now > waiters[i].deadline) {
        reports_.add(waiters[i].id, Status::error(ErrorKind::Timeout, cat(what, " timed out")));
        waiters.erase(waiters.begin() + i);
      } else {
        ++i;
      }
    }
  };
  expire(receivers_, "recv");
  for (auto& [tag, n] : notices_) expire(n.waiters, "notification");
}

void Inbox::close(const Status& closed) {
  for (auto& w : receivers_) reports_.add(w.id, closed);
  receivers_.clear();
  for (auto& [tag, n] : notices_)
    for (auto& w : n.waiters) reports_.add(w.id, closed);
  notices_.clear();
}

}  // namespace p2p::engine
