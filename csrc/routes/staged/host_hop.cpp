// The staged route's host hop by cma: between processes of one host, the RMA steps of slot jobs
// become copies with the peer's process, lent by the cma route (PeerCopies, core/route.h),
// where it reaches the peer.
//
// What each side may touch stays what the fabric allows it:
//  - RmaRuns (slot <-> a directly registered region of the owner): the initiator copies into
//    the owner's process, so the owner answers for the region first (core/grants.h, as for the
//    cma route's own transfers) and the call is checked against the answer (access, bounds,
//    the handle against the registration) before any job is made; the jobs then copy only
//    runs of the checked call.
//  - RmaSlot (the owner's slot <-> the requester's slot): the owner copies, and the request
//    names the requester's slot by its address (StageRequest::slot). That address is used only
//    as the remote end of a copy into or out of the requester's own process, of the request's
//    bytes (at most one slot, checked); the owner's end is its own serve slot, which it picked.
//    Nothing of the request addresses the owner's memory except the runs in its region, which
//    are checked as before and touched only by the pack or unpack. A requester that names
//    another address of its own can only make the copy fail (EFAULT, refused to it) or move
//    its own bytes where it said: its own business.
//  - The requester's slot is reachable by the owner's copies while the request is out, so the
//    requester takes it back only on the answer (SlotJob::in_flight), even for a transfer that
//    ended meanwhile; from a failed peer, only once its process has exited (hold_slot).
#include <algorithm>

#include "routes/staged/route.h"

namespace p2p::staged {

using namespace core;

void SlotJob::copied(const Status& status) { route->job_op_done(*this, status); }

// Into host memory of a peer the cma route reaches, directly registered (a staged region's
// owner drives its own hop).
bool Route::runs_by_cma(const Transfer& t) const {
  return same_host_ && same_host_->reaches(*t.peer) &&
         std::all_of(t.remote.begin(), t.remote.end(), [](auto& r) { return r->on_nics && r->device_type == 0; });
}

// Queues t for its jobs once the owner answered for each of its regions; by cma, its runs'
// remote offsets turned into addresses in the owner's process, if the call passes the checks
// (else it fails) and the OS lets us at the peer (else its jobs take the fabric). False while
// an answer is missing.
bool Route::queue_by_cma(Transfer& t) {
  if (!grants_.answered(t)) return false;
  if (!t.reported() && same_host_->reaches(*t.peer)) {
    size_t i = 0;  // resolve() visits t.runs in order, and t has no pages left (take())
    const Status s = grants_.resolve(t, [&](uint8_t*, uint64_t remote, uint64_t) { t.runs[i++].remote = remote; });
    if (!s.ok()) {
      host_.done(t, s);
      return true;
    }
    by_cma_.insert(&t);
  }
  queue_.push_back({&t, {}});
  return true;
}

void Route::on_grant_message(Peer& p, std::string_view body) {
  const Grants::Grant* grant = grants_.on_message(p, body);
  if (!grant) return;  // an ask (answered), or nothing new
  if (grant->refused.ok() && grant->nbytes > 0) same_host_->allowed(p, grant->ptr);
  grants_.resume(p, [&](Transfer& t) { return queue_by_cma(t); });
}

// The job's Rma step as one copy, counted as its one op.
void Route::copy_by_cma(SlotJob& job) {
  std::vector<Span> spans;
  if (job.step() == Step::RmaSlot) {
    spans.push_back({job.slot->ptr, job.peer_slot, job.bytes});
  } else {
    uint64_t offset = 0;
    for (const Run& run : job.runs) {  // remote: the owner's addresses (queue_by_cma)
      spans.push_back({job.slot->ptr + offset, run.remote, run.len});
      offset += run.len;
    }
  }
  job.state = SlotJobState::Moving;
  job.ops_left = 1;
  same_host_->copy(*job.peer, std::move(spans), job.write_out, job);
}

}  // namespace p2p::staged
