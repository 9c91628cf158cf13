// Transfer's state machine, apart from the worker: what may follow what, and what comes next.
#include "core/transfer.h"

#include "core/route.h"

namespace p2p::core {

const char* name(TransferState state) {
  switch (state) {
    case TransferState::New: return "New";
    case TransferState::WaitingForPeer: return "WaitingForPeer";
    case TransferState::Queued: return "Queued";
    case TransferState::Running: return "Running";
    case TransferState::AwaitingAck: return "AwaitingAck";
    case TransferState::Notifying: return "Notifying";
    case TransferState::Reported: return "Reported";
  }
  return "?";
}

const char* name(TransferStep step) {
  switch (step) {
    case TransferStep::Wait: return "Wait";
    case TransferStep::AwaitAck: return "AwaitAck";
    case TransferStep::Confirm: return "Confirm";
    case TransferStep::Report: return "Report";
  }
  return "?";
}

void Transfer::op_done(RouteHost& host, Op&, const Status& status) { host.transfer_op_done(*this, status); }

void Transfer::recycle() {
  auto emptied = [](auto& buffer) {
    auto kept = std::move(buffer);
    kept.clear();
    return kept;
  };
  auto local_ids_kept = emptied(local_ids);
  auto remote_kept = emptied(remote);
  auto runs_kept = emptied(runs);
  auto pages_kept = emptied(pages);
  auto page_ids_kept = emptied(page_ids);
  auto local_kept = emptied(local);
  auto address_kept = emptied(peer_address);
  *this = Transfer();
  local_ids = std::move(local_ids_kept);
  remote = std::move(remote_kept);
  runs = std::move(runs_kept);
  pages = std::move(pages_kept);
  page_ids = std::move(page_ids_kept);
  local = std::move(local_kept);
  peer_address = std::move(address_kept);
}

std::unique_ptr<Transfer> TransferPool::take() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!spare_.empty()) {
      std::unique_ptr<Transfer> t = std::move(spare_.back());
      spare_.pop_back();
      return t;
    }
  }
  return std::make_unique<Transfer>();
}

void TransferPool::give(std::unique_ptr<Transfer> t) {
  t->recycle();
  std::lock_guard<std::mutex> lock(mu_);
  if (spare_.size() < kSpare) spare_.push_back(std::move(t));
}

TransferStep Transfer::next_step(bool needs_confirm) const {
  using S = TransferState;
  if (state == S::Reported) return TransferStep::Wait;
  // Fail fast: what is still in flight drains in the background. A held failure waits for
  // the check of the peer (Worker::peer_ready or Peers::fail reports it).
  if (!status.ok()) return held ? TransferStep::Wait : TransferStep::Report;
  switch (state) {
    case S::Running:
      if (pending > 0) return TransferStep::Wait;
      if (kind == TransferKind::Message && !acked) return TransferStep::AwaitAck;
      return needs_confirm ? TransferStep::Confirm : TransferStep::Report;
    case S::AwaitingAck:
      return acked ? TransferStep::Report : TransferStep::Wait;
    case S::Notifying:
      return pending > 0 ? TransferStep::Wait : TransferStep::Report;
    default:  // nothing done yet can finish it
      return TransferStep::Wait;
  }
}

void Transfer::pages_to_runs() {
  for (const PageRuns& p : pages) append_page_runs(p, page_ids.data(), runs);
  pages = {};
  page_ids = {};
}

void Transfer::enter(TransferState to) {
  using S = TransferState;
  bool allowed = false;
  switch (to) {
    case S::New: allowed = false; break;
    case S::WaitingForPeer: allowed = state == S::New; break;
    case S::Queued: allowed = state == S::New || state == S::WaitingForPeer; break;
    case S::Running: allowed = state == S::New || state == S::WaitingForPeer || state == S::Queued; break;
    case S::AwaitingAck: allowed = state == S::Running; break;
    case S::Notifying: allowed = state == S::Running || state == S::AwaitingAck; break;
    case S::Reported: allowed = state != S::Reported; break;
  }
  if (!allowed) throw_error(ErrorKind::Generic, cat("internal error: transfer ", id, " cannot go from ", name(state),
                                                    " to ", name(to)), __FILE__, __LINE__);
  state = to;
}

}  // namespace p2p::core
