// User messages (send / recv) and notifications (a write's notice to its receiver), on the
// receiving side; and cancel() of whatever waits for them.
#include "common/log.h"
#include "engine/worker.h"

namespace p2p::engine {

void Worker::on_user(Peer& p, const UserFragment& m) {
  std::string& buf = p.partial[m.id];
  // Fragments arrive in order (send-after-send), so each continues the last.
  if (m.offset != buf.size() || m.offset + m.part.size() > m.total) {
    p.partial.erase(m.id);
    throw Error(ErrorKind::Value, "invalid control message: message fragment out of order");
  }
  if (buf.empty()) buf.reserve(m.total);
  buf.append(m.part);
  if (buf.size() < m.total) return;
  std::string payload = std::move(buf);
  p.partial.erase(m.id);
  // Acknowledged here, in the step that takes it: a close() that the delivery itself triggers
  // (a recv callback) comes later and sends this first.
  send_control(p, message(UserAck{m.id}, p));
  if (!recv_waiters_.empty()) {
    const uint64_t waiter = recv_waiters_.front().id;
    recv_waiters_.erase(recv_waiters_.begin());
    return report(waiter, Status{}, std::move(payload), p.address_bytes);
  }
  inbox_.emplace_back(p.address_bytes, std::move(payload));
}

void Worker::on_user_ack(Peer& p, const UserAck& m) {
  auto entry = p.unacked.find(m.id);
  if (entry == p.unacked.end()) return;
  const uint64_t transfer = entry->second;
  p.unacked.erase(entry);
  acknowledged(p, transfer);
}

void Worker::recv(uint64_t id, double timeout_s) {
  assert_on_worker();
  if (!inbox_.empty()) {
    auto [address, payload] = std::move(inbox_.front());
    inbox_.erase(inbox_.begin());
    return report(id, Status{}, std::move(payload), std::move(address));
  }
  recv_waiters_.push_back({id, timeout_s > 0 ? now() + timeout_s : 0});
}

void Worker::on_notify(const Notify& m) {
  Status status{m.kind, std::string(m.message)};
  if (!status.ok()) status.message = cat("the sender's write failed: ", status.message);
  NotifyState& s = notify_[m.id];
  if (!s.waiters.empty()) {
    const uint64_t waiter = s.waiters.front().id;
    s.waiters.erase(s.waiters.begin());
    return report(waiter, std::move(status));
  }
  s.arrived.push_back(std::move(status));
}

void Worker::notification(uint64_t id, uint32_t tag, double timeout_s) {
  assert_on_worker();
  NotifyState& s = notify_[tag];
  if (!s.arrived.empty()) {
    Status status = std::move(s.arrived.front());
    s.arrived.erase(s.arrived.begin());
    return report(id, std::move(status));
  }
  s.waiters.push_back({id, timeout_s > 0 ? now() + timeout_s : 0});
}

void Worker::cancel(uint64_t id) {
  assert_on_worker();
  const Status cancelled = Status::error(ErrorKind::Cancelled, "cancelled");
  auto drop = [&](std::vector<Waiter>& waiters) {
    for (size_t i = 0; i < waiters.size(); ++i) {
      if (waiters[i].id != id) continue;
      waiters.erase(waiters.begin() + i);
      report(id, cancelled);
      return true;
    }
    return false;
  };
  if (drop(recv_waiters_)) return;
  for (auto& [tag, s] : notify_)
    if (drop(s.waiters)) return;
  auto it = transfers_.find(id);
  if (it != transfers_.end()) fail(*it->second, cancelled);
}


}  // namespace p2p::engine
