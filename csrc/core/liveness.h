// Liveness: one peer's connection state and the schedule that decides when to question it and
// when to give up on it. Plain data and arithmetic: the clock is passed in, so tests drive it
// with a fake one (_C._Liveness); the worker sends the HELLOs and fails the peer.
//
// Thread: the worker's.
//
//  - Connecting: a HELLO went out; the peer must answer within the timeout.
//  - Ready: it answered as itself. While something waits on it, a silence of a quarter of the
//    timeout starts a check: a HELLO again, which must be answered by the end of the timeout.
//    Only a peer that something waits on is watched; an idle one costs nothing.
//  - A HELLO that fails while the connection under it is torn down is sent again after a
//    growing pause, until the deadline; any other failure is final.
//  - Dead or Left: final for every call of that contact; a later call or connect() to the peer
//    begins a new contact (Connecting), unless its process is gone (Peer::closed); after its
//    own goodbye (Peer::left_us), only connect() does.
#pragma once

#include <cstdint>

namespace p2p::core {

enum class PeerState : uint8_t { Connecting, Ready, Dead, Left };
const char* name(PeerState state);

class Liveness {
 public:
  explicit Liveness(double timeout_s) : timeout_s_(timeout_s) {}

  PeerState state() const { return state_; }
  bool failed() const { return state_ == PeerState::Dead || state_ == PeerState::Left; }
  bool checking() const { return checking_; }
  // New transfers wait for the peer's answer.
  bool waits() const { return state_ == PeerState::Connecting || checking_; }
  double last_heard() const { return last_heard_; }

  // A HELLO goes out to introduce us (again): Connecting, answer due within the timeout.
  void connect(double now);
  // It answered as itself: Ready, and a check under way is over.
  void answered();
  // Dead or Left.
  void fail(PeerState state);
  // Asks a Ready peer again, to be answered by `deadline`. True: send a HELLO now.
  bool start_check(double deadline);
  // A sign of life: a message, or an op to it that completed.
  void heard(double now) { last_heard_ = now; }
  // Something begins to wait on a peer nothing waited on: its silence counts from here, not
  // from before (an idle peer would otherwise be checked at once, its deadline already past).
  void watch_from(double now);

  // A HELLO to it failed; transient: its connection was being torn down.
  enum class Retry : uint8_t {
    Ignore,  // nothing waits on that HELLO any more (answered, or failed, meanwhile)
    Later,   // send it again at retry_at()
    GiveUp,  // the peer is dead
  };
  Retry hello_failed(double now, bool transient);
  double retry_at() const { return hello_again_; }

  // What is due at `now`; busy: something waits on the peer.
  enum class Verdict : uint8_t {
    Alive,
    Unanswered,  // Connecting past its deadline
    Silent,      // a check went unanswered
  };
  struct Due {
    bool send_hello = false;  // a pause after a failed HELLO is over, or a check begins
    Verdict verdict = Verdict::Alive;
  };
  Due tick(double now, bool busy);

 private:
  double timeout_s_;
  PeerState state_ = PeerState::Connecting;
  bool checking_ = false;
  double last_heard_ = 0;        // its last sign of life, or when we began waiting on it
  double connect_deadline_ = 0;
  double check_deadline_ = 0;
  int hello_failures_ = 0;       // HELLOs lost to a connection being torn down, in a row
  double hello_again_ = 0;       // when to send the next one, 0 = none due
};

}  // namespace p2p::core
