// The staged path: for memory the NICs cannot reach (CUDA memory without FI_HMEM, or any
// memory with data_path="staged"), bytes move through a bounded pool of pinned host slots.
//
//  - The pool is split in two halves: slots for transfers this engine starts, and slots for
//    serving peers' requests. Serving never waits on anything but its own RMA and copies,
//    so two staged engines writing to each other cannot deadlock on slots.
//  - The side with staged memory drives the RMA. A write to a staged remote region: the
//    initiator packs its data into a slot and sends a StageRequest (messages.h); the owner
//    pulls it into one of its slots (RMA read), copies it into place and answers StageAck. A
//    read: the owner
//    packs into its slot and pushes it (RMA write) into the initiator's slot.
//  - Back-pressure instead of growth: a transfer waits for a slot, a request for a serve slot.
//  - On one host the host hop skips the fabric where the cma route reaches the peer
//    (PeerCopies, core/route.h): the RMA steps become one cross-memory copy each. Into a
//    directly registered region (RmaRuns) the initiator copies straight into the owner's
//    memory, within what the owner answered for the region (core/grants.h); between slots
//    (RmaSlot) the owner copies between its slot and the requester's, whose address the
//    request carries if the requester allows it (StageRequest::slot).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/wire.h"
#include "core/copier.h"
#include "core/ops.h"
#include "core/region.h"
#include "core/route.h"
#include "core/runs.h"
#include "core/striper.h"
#include "fabric/rail.h"
#include "routes/staged/messages.h"

namespace p2p::staged {

using core::CopyOwner;
using core::CopySpan;
using core::OpOwner;
using core::Peer;
using core::Region;
using core::Run;
using core::RunCursor;
using core::Transfer;

class Route;

// Runs per slot job: bounded by what a StageRequest carries and by the copy kernel's span list.
constexpr size_t kMaxJobRuns = 512;

struct Slot {
  uint8_t* ptr = nullptr;
  uint64_t bytes = 0;
  bool serve = false;
  std::vector<fabric::MrHandle> mrs;  // one per rail
  CopySpan* spans = nullptr;          // pinned room for kMaxJobRuns spans
};

enum class Step : uint8_t {
  Pack,     // memory -> slot
  Unpack,   // slot -> memory
  RmaRuns,  // slot <-> remote runs of a directly registered remote region
  RmaSlot,  // slot <-> the requesting peer's slot (serving)
  Request,  // send StageRequest, wait for StageAck
  Ack,      // send StageAck
  Done,
};

// Where a job stands within its current step; staged::Route::advance moves it.
enum class SlotJobState : uint8_t {
  Ready,       // the step has not begun
  Copying,     // a pack or unpack runs on the copier (the job is in the route's copying_ list)
  Copied,      // that copy has finished; its error is checked next
  Generating,  // waits in the route's job_gen_queue_ for room to make its RMA ops
  Moving,      // every RMA op is made; ops_left of them are in flight
  Requesting,  // StageRequest sent; on_stage_ack moves on
};
const char* name(SlotJobState state);

// One slot's worth of a staged transfer, on the initiator or on the serving side: a short
// plan of steps (`steps`, the current one `cur`) and where the current one stands (`state`).
struct SlotJob final : OpOwner, CopyOwner {
  uint64_t id = 0;  // also the request id on the wire
  Step steps[4] = {Step::Done, Step::Done, Step::Done, Step::Done};
  uint8_t cur = 0;
  SlotJobState state = SlotJobState::Ready;
  bool write_out = false;  // Rma steps write from the slot (else read into it)
  // The host hop goes by cma: an Rma step is one copy with the peer's process (its one op);
  // a Request lets the owner copy with our slot, so the slot is ours again only after the
  // answer (or the owner's exit).
  bool cma = false;
  Slot* slot = nullptr;
  std::vector<Run> runs;   // local address <-> remote offset; slot offsets follow run order
  uint64_t bytes = 0;
  Peer* peer = nullptr;
  Route* route = nullptr;  // its owner
  Transfer* transfer = nullptr;    // initiator side

  // Serving side: the request.
  uint64_t request = 0;
  std::shared_ptr<Region> region;
  std::vector<uint64_t> peer_base, peer_key;  // the initiator's slot, per initiator rail
  uint64_t peer_slot = 0;                     // its address in the initiator's process (cma)

  // Progress.
  size_t ops_left = 0;
  RunCursor gen;          // through runs (RmaRuns) or the slot (RmaSlot)
  uint64_t gen_slot = 0;  // slot bytes taken by ops
  uint64_t ticket = 0;    // of the copy (Copying, Copied)
  Status status;

  Step step() const { return steps[cur]; }
  void next_step() {
    ++cur;
    state = SlotJobState::Ready;
  }
  // Something still uses the slot: a failed job finishes only once this is false.
  bool in_flight() const {
    return state == SlotJobState::Copying || state == SlotJobState::Generating ||
           (state == SlotJobState::Moving && ops_left > 0) || (state == SlotJobState::Requesting && cma);
  }
  void op_done(core::RouteHost& host, core::Op& op, const Status& status) override;
  void copied(const Status& status) override;
  bool abandoned() const override { return !status.ok(); }
};

// Why the owner refuses `req` for `region` (null: not registered) with slots of max_bytes,
// or "" when it serves it; fills in the runs' local addresses.
std::string stage_request_refusal(StageRequest& req, const Region* region, uint64_t max_bytes);

}  // namespace p2p::staged
