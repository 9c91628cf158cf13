// The worker's operations: completions in (Rail::drain, or the rail threads' events), what a
// failed op says about its peer, and posting out.
#include "engine/worker.h"

#include <rdma/fi_errno.h>

#include <algorithm>
#include <cerrno>

#include "common/log.h"

namespace p2p::engine {
namespace {

bool is_connection_errno(int err) {
  switch (err) {
    case FI_ECONNREFUSED:
    case FI_ECONNRESET:
    case FI_ECONNABORTED:
    case FI_ENOTCONN:
    case FI_EHOSTUNREACH:
    case FI_ETIMEDOUT:
    case EPIPE:
      return true;
    default:
      return false;
  }
}

// What a failed op says about its peer. Providers report a refused key or range in different
// ways (tcp: FI_ECANCELED with the errno of the cause in prov_errno), so only connection
// errors count as the peer's; the rest is the owner refusing the access.
ErrorKind classify(int err, int prov_errno) {
  if (is_connection_errno(err)) return ErrorKind::Peer;
  if (err == FI_ECANCELED) return is_connection_errno(prov_errno) ? ErrorKind::Peer : ErrorKind::Remote;
  if (err == FI_EACCES || err == FI_EINVAL || err == FI_ENOKEY || err == FI_EKEYREJECTED || err == FI_EPERM)
    return ErrorKind::Remote;
  return ErrorKind::Generic;
}

const char* op_name(OpKind kind) {
  switch (kind) {
    case OpKind::Write: return "RMA write";
    case OpKind::Read: return "RMA read";
    case OpKind::Send: return "message";
    case OpKind::Recv: return "receive";
    case OpKind::Forget: return "forget";
  }
  return "op";
}

}  // namespace

void Worker::post_receive(Op* op) {
  if (RailDriver* driver = rails_[0].driver) {
    op->rail = 0;
    if (!driver->submit(op)) P2P_LOG(Error, "could not hand a receive buffer to its rail thread");
    driver->kick();
    return;
  }
  ssize_t rc;
  while ((rc = rails_[0].rail->recv(op->iov[0].iov_base, op->iov[0].iov_len, op->desc[0], &op->ctx)) == -FI_EAGAIN)
    drain_cq(*rails_[0].rail, 1);  // the provider's receive queue is full: take what completed
  if (rc < 0) P2P_LOG(Error, "could not post a receive buffer: ", fi_error_name(-rc));
}


// ---------------------------------------------------------------------------------------------
// Completions.

bool Worker::poll_rails() {
  bool any = false;
  for (auto& d : drivers_) {
    any |= d->drain([&](const RailDriver::Event& e) {
      if (e.error) {
        op_failed(e.op, e.error, e.prov_errno, *e.message);
        delete e.message;
      } else {
        on_completion(e.op, e.len);
      }
    });
  }
  for (auto& rs : rails_)
    if (!rs.driver) any |= drain_cq(*rs.rail, 4);
  return any;
}

bool Worker::drain_cq(fabric::Rail& rail, int rounds) {
  return rail.drain(
      rounds, [&](void* op, size_t len) { on_completion(static_cast<Op*>(op), len); },
      [&](const fi_cq_err_entry& err, const std::string& message) {
        if (!err.op_context) {
          P2P_LOG(Warn, "completion error without an operation: ", message);
          return;
        }
        op_failed(static_cast<Op*>(err.op_context), err.err, err.prov_errno, message);
      });
}

void Worker::on_completion(Op* op, size_t len) {
  if (!op) return;
  if (op->kind == OpKind::Forget) return pool_->release(op);
  if (op->kind == OpKind::Recv) {
    on_message(static_cast<const char*>(op->local()), len);
    post_receive(op);
    return;
  }
  complete_op(op, Status{});
}

void Worker::op_failed(Op* op, int err, int prov_errno, const std::string& message) {
  if (op->kind == OpKind::Recv) {
    if (stopping_.load()) return;
    P2P_LOG(Warn, "a control message was not received: ", message);
    post_receive(op);
    return;
  }
  Peer* peer = op->peer;
  const ErrorKind kind = classify(err, prov_errno);
  std::string who = peer ? cat(" to peer ", hex(peer->incarnation)) : std::string();
  Status status = Status::error(kind, cat(op_name(op->kind), who, " failed: ", message));
  const bool hello = op->hello, orphaned = op->orphaned;
  complete_op(op, status);
  if (!peer || orphaned || stopping_.load()) return;
  // A failed op does not say whether its peer is gone: the owner may have refused an RMA (and
  // tcp;ofi_rxm then drops the connection), or a new process may have taken its address. A
  // HELLO finds out (check()); the peer is dead if that fails or goes unanswered.
  if (hello) return on_hello_failed(*peer, err, prov_errno, status);
  check(*peer, now() + config_.peer_timeout_s);
}

void Worker::complete_op(Op* op, const Status& status) {
  control_.release(*op);
  if (op->orphaned) {  // its owner heard already, when the peer was declared dead
    if (op->region) {
      auto pin = orphan_pins_.find(op->region);
      if (--pin->second.second == 0) orphan_pins_.erase(pin);
    }
    pool_->release(op);
    return;
  }
  if (op->posted) --rails_[op->rail].inflight;
  if (status.ok() && op->peer) op->peer->live.heard(now());
  OpOwner* owner = op->owner;
  if (owner) owner->op_done(*this, *op, status);
  pool_->release(op);
}

// ---------------------------------------------------------------------------------------------
// Posting: per rail, up to `batch` ops, FI_MORE on all but the last (the doorbell rings on
// the last one); an op refused with -FI_EAGAIN goes back to the front of its queue, and ops to
// other peers pass it (post_queue).
//
// NOTE: a batch never exceeds the rail's free credits (our count of posted ops against its
// tx queue size), so -FI_EAGAIN after FI_MORE posts, which could leave a batch without its
// doorbell until the next post, comes only from a peer whose connection is full;
// TORCH_P2P_POST_BATCH=1 turns batching off.

bool Worker::post_ops() {
  bool any = send_forgets();
  for (auto& rs : rails_) {
    if (rs.driver) {
      any |= hand_over(rs);
      continue;
    }
    const size_t budget = std::min(config_.batch, rs.depth - std::min(rs.depth, rs.inflight));
    post_queue(*rs.rail, rs.pending, budget, [&](Op& op) { return usable(&op); }, [&](Op& op, ssize_t rc) {
      any = true;
      if (rc == 0) {
        op.posted = true;
        ++rs.inflight;
        return;
      }
      std::string who = op.peer ? cat(" to peer ", hex(op.peer->incarnation)) : std::string();
      complete_op(&op, Status::error(ErrorKind::Generic, cat("posting a ", op_name(op.kind), who, " on ",
                                                             rs.rail->domain_name(), " failed: ", fi_error_name(-rc))));
    });
  }
  return any;
}

// False (and the op completed) when it must not be posted: its peer failed or its owner gave up.
bool Worker::usable(Op* op) {
  if (op->peer && op->peer->failed() && (!op->farewell || op->peer->closed)) {
    complete_op(op, op->peer->failure);
    return false;
  }
  if (op->owner && op->owner->abandoned()) {
    complete_op(op, Status::error(ErrorKind::Cancelled, "abandoned"));
    return false;
  }
  return true;
}

// Ops for a driven rail go to its driver, as many as the rail has credits for; not while the
// driver still has to hear that a peer failed (it would drop ops to the peer revived).
bool Worker::hand_over(RailState& rs) {
  for (auto& f : forgets_)
    if (f.first == rs.driver) return false;
  bool any = false;
  while (rs.inflight < rs.depth && !rs.pending.empty()) {
    Op* op = rs.pending.front();
    if (!usable(op)) {
      rs.pending.pop_front();
      continue;
    }
    if (!rs.driver->submit(op)) break;
    rs.pending.pop_front();
    op->posted = true;
    ++rs.inflight;
    any = true;
  }
  if (any) rs.driver->kick();
  return any;
}

// Tells the rail threads about failed peers (Forget markers), in order with the ops handed over.
bool Worker::send_forgets() {
  size_t kept = 0;
  for (auto& [driver, peer] : forgets_) {
    Op* marker = new_op(OpKind::Forget, 0, nullptr, peer);
    if (marker && driver->submit(marker)) {
      driver->kick();
      continue;
    }
    if (marker) pool_->release(marker);
    forgets_[kept++] = {driver, peer};
  }
  const bool any = kept < forgets_.size();
  forgets_.resize(kept);
  return any;
}

Op* Worker::new_op(OpKind kind, uint16_t rail, OpOwner* owner, Peer* peer) {
  Op* op = pool_->acquire();
  if (!op) return nullptr;
  op->kind = kind;
  op->rail = rail;
  op->owner = owner;
  op->peer = peer;
  return op;
}

}  // namespace p2p::engine
