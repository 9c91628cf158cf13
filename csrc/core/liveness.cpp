#include "core/liveness.h"

#include <algorithm>

namespace p2p::core {

const char* name(PeerState state) {
  switch (state) {
    case PeerState::Connecting: return "Connecting";
    case PeerState::Ready: return "Ready";
    case PeerState::Dead: return "Dead";
    case PeerState::Left: return "Left";
  }
  return "?";
}

void Liveness::connect(double now) {
  state_ = PeerState::Connecting;
  checking_ = false;
  hello_failures_ = 0;
  hello_again_ = 0;
  last_heard_ = now;
  connect_deadline_ = now + timeout_s_;
}

void Liveness::answered() {
  state_ = PeerState::Ready;
  checking_ = false;
}

void Liveness::fail(PeerState state) {
  state_ = state;
  checking_ = false;
}

bool Liveness::start_check(double deadline) {
  if (state_ != PeerState::Ready || checking_) return false;
  checking_ = true;
  hello_failures_ = 0;
  hello_again_ = 0;
  check_deadline_ = deadline;
  return true;
}

void Liveness::watch_from(double now) { last_heard_ = std::max(last_heard_, now); }

// NOTE: on tcp;ofi_rxm every peer named by one network address shares a connection, and a
// refused RMA makes the provider drop it: HELLOs posted during the teardown fail with
// FI_ENOTCONN / EPIPE, several in a row when sent at once. A growing pause outlasts the
// teardown.
Liveness::Retry Liveness::hello_failed(double now, bool transient) {
  if (!waits()) return Retry::Ignore;
  const double deadline = checking_ ? check_deadline_ : connect_deadline_;
  const double pause = std::min(0.5, 0.01 * (1 << std::min(hello_failures_++, 6)));
  if (!transient || now + pause >= deadline) return Retry::GiveUp;
  hello_again_ = now + pause;
  return Retry::Later;
}

Liveness::Due Liveness::tick(double now, bool busy) {
  Due due;
  if (hello_again_ > 0 && now >= hello_again_) {
    hello_again_ = 0;
    due.send_hello = waits();
  }
  if (state_ == PeerState::Connecting && now > connect_deadline_) {
    due.verdict = Verdict::Unanswered;
  } else if (checking_ && now > check_deadline_) {
    due.verdict = Verdict::Silent;
  } else if (state_ == PeerState::Ready && busy && now - last_heard_ > timeout_s_ / 4) {
    due.send_hello |= start_check(last_heard_ + timeout_s_);
  }
  return due;
}

}  // namespace p2p::core
