// Transfer: one call of write_slices / read_slices / send, and its life as a state machine.
//
// The engine creates it on a Python thread; from Worker::post() on, only the worker touches
// it. Its life is one TransferState, moved forward by Worker::advance(Transfer&), which does
// what next_step() decides from the transfer's facts, and by Worker::finish(), which gives
// the future its result from any state.
//
//   New -> WaitingForPeer -> Queued -> Running -> AwaitingAck -> Notifying -> Reported
//
// Any state may end in Reported (a failure, the deadline, cancel()); WaitingForPeer and
// Queued are skipped where there is nothing to wait for, AwaitingAck and Notifying where no
// fence, acknowledgement or notification is due.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/error.h"
#include "core/address.h"
#include "core/ops.h"
#include "core/region.h"
#include "core/runs.h"
#include "core/striper.h"

namespace p2p::core {

struct Peer;

enum class TransferKind : uint8_t { Write, Read, Message };

enum class TransferState : uint8_t {
  New,             // made by the engine; the worker has not looked at it yet
  WaitingForPeer,  // its peer is connecting or being checked (in Peer::waiting)
  Queued,          // in the generation queue, or parked there for a staging slot
  Running,         // every op or job exists (or the IPC copy is queued)
  AwaitingAck,     // its ops are done; its route's confirmation, or a message's UserAck, is due
  Notifying,       // it succeeded; the future completes once the Notify to the receiver leaves
  Reported,        // the future has its result; freed once no op, job or queue refers to it
};
const char* name(TransferState state);

// What advance() does next.
enum class TransferStep : uint8_t {
  Wait,      // nothing until more completes or arrives
  AwaitAck,  // a message is out: wait for the receiver's acknowledgement
  Confirm,   // its route asks the peer to confirm it (Route::confirm), and waits
  Report,    // the result is known: finish()
};
const char* name(TransferStep step);

// The call, as the engine made it: all a transfer needs to start. A prepared call keeps one
// and each run copies it into a new transfer.
struct TransferCall {
  uint64_t id = 0;
  TransferKind kind = TransferKind::Write;
  std::string peer_address;
  std::vector<uint64_t> local_ids;  // resolved into `local` by the worker
  std::vector<std::shared_ptr<const RemoteRegion>> remote;
  std::vector<Run> runs;
  // Entries of whole-run pages, kept as pages (see PageRuns) until a route needs their runs.
  std::vector<PageRuns> pages;
  std::vector<int64_t> page_ids;
  std::string payload;  // Message
  bool notify = false;  // the receiver hears of the end (notification(tag))
  uint32_t tag = 0;
  void* cuda_event = nullptr;  // the caller's stream work this transfer must follow
  double timeout_s = 0;
};

struct Transfer final : OpOwner, TransferCall {
  // Worker state.
  TransferState state = TransferState::New;
  // The registry index of the route that moves it (core/route.h), once its regions and its
  // peer are known.
  static constexpr uint8_t kNoRoute = 0xff;
  uint8_t route = kNoRoute;
  Peer* peer = nullptr;
  std::vector<std::shared_ptr<Region>> local;
  double deadline = 0;
  size_t pending = 0;  // ops, slot jobs or IPC copies not finished (the Notify too)
  Status status;       // the first failure, if any
  // Facts that are not steps of its life, so not states:
  //  - queued: a route's queue (the fabric route's, the staged route's slot waiters) holds a
  //    pointer to it. That pointer outlives Queued: a transfer reported while queued leaves the
  //    queue only when its route reaches it, and must not be freed before.
  //  - held: it failed, but the caller hears only once a check of the peer tells whether the
  //    peer restarted (check()), which is then the error reported. A hold begins in whichever
  //    state an op fails (Queued, Running, Notifying) and that state must be kept.
  //  - acked: the peer acknowledged it. A message's UserAck may arrive before the send's own
  //    completion, that is, before the transfer reaches AwaitingAck.
  //  - report_due: it failed with ops, slot jobs or copies still out; the future hears once
  //    they are back (Worker::maybe_free), so that no byte of the call moves after it.
  bool queued = false;
  bool held = false;
  bool acked = false;
  bool report_due = false;
  double take_back_until = 0;  // timed out or cancelled: when its posted ops are let go (Worker::let_go)

  bool reported() const { return state == TransferState::Reported; }
  bool routed() const { return route != kNoRoute; }
  // Decides advance()'s next move; needs_confirm: the peer must confirm that its bytes landed
  // (Route::confirms).
  TransferStep next_step(bool needs_confirm) const;
  // Moves to `to`; a move the diagram above does not allow is a bug (asserted).
  void enter(TransferState to);
  // The pages as byte runs after the plain runs, for the paths that move runs.
  void pages_to_runs();

  void op_done(RouteHost& host, Op& op, const Status& status) override;
  bool abandoned() const override { return reported() || !status.ok(); }  // nothing more of a failed call goes out
  // Back to a new transfer's state, keeping the buffers' capacity (TransferPool).
  void recycle();
};

// Finished transfers, for new calls to reuse: the worker gives them back, the engine takes
// them. NOTE: a call's transfer and buffers were allocated on the calling thread and freed on
// the worker's, which glibc's per-thread caches serve badly: with jemalloc preloaded instead,
// a paged call's checks took 1.4 / 3.7 us (1 / 256 pages) instead of 2.8 / 5.6 on the H100
// machine. Reused buffers allocate nothing in steady state.
class TransferPool {
 public:
  std::unique_ptr<Transfer> take();
  void give(std::unique_ptr<Transfer> t);  // keeps at most kSpare

 private:
  static constexpr size_t kSpare = 256;
  std::mutex mu_;
  std::vector<std::unique_ptr<Transfer>> spare_;
};

}  // namespace p2p::core
