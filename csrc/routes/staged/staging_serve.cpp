// The serving side of the staged path (staging.h): a peer's StageRequest is checked as the
// provider would check direct RMA, then served by a slot job from the serve half of the pool.
#include "common/log.h"
#include "routes/staged/route.h"

namespace p2p::staged {

using namespace core;

// The owner checks what its provider would check for direct RMA: region, access, bounds. It
// also fills in the runs' local addresses.
std::string stage_request_refusal(StageRequest& req, const Region* region, uint64_t max_bytes) {
  const uint64_t id = req.region_id;
  if (!region || region->closing) return cat("region ", id, " is not registered (deregistered?)");
  if (region->on_nics()) return cat("region ", id, " is registered for direct RMA");
  if (req.dir == kOwnerPulls && !(region->access & kRemoteWrite))
    return cat("region ", id, " does not accept remote writes (registered with access='r')");
  if (req.dir == kOwnerPushes && !(region->access & kRemoteRead))
    return cat("region ", id, " does not accept remote reads (registered with access='w')");
  uint64_t sum = 0;
  for (auto& run : req.runs) {
    if (run.len == 0 || run.remote > region->nbytes || run.len > region->nbytes - run.remote)
      return cat("a run lies outside region ", id);
    run.local = reinterpret_cast<uint64_t>(region->ptr) + run.remote;
    sum += run.len;
  }
  if (sum != req.bytes || req.bytes == 0 || req.bytes > max_bytes) return "malformed stage request";
  return {};
}

void Route::send_ack(Peer& p, uint64_t request, const Status& status) {
  if (p.failed()) return;
  ByteWriter w;
  StageAck{request, status.kind, status.message}.write(w);
  host_.send(p, id_, std::move(w.str()));
}

// A request or an answer; else the host hop's grants (host_hop.cpp).
void Route::on_message(Peer& p, std::string_view body) {
  if (Grants::carries(body)) return on_grant_message(p, body);
  ByteReader r(body, "staged message");
  const uint8_t kind = r.get<uint8_t>();
  if (kind == kStageRequest)
    on_stage_request(p, StageRequest::read(r));
  else if (kind == kStageAck)
    on_stage_ack(StageAck::read(r));
  else
    r.fail("unknown kind");
}

void Route::on_stage_request(Peer& p, StageRequest req) {
  if (req.base.size() != p.remote_rails())
    throw Error(ErrorKind::Value, "invalid control message: bad stage request");
  std::shared_ptr<Region> region = host_.region(req.region_id);
  if (const std::string why = stage_request_refusal(req, region.get(), slot_size(host_.config().slot_bytes));
      !why.empty())
    return send_ack(p, req.request, Status::error(ErrorKind::Remote, why));
  serve(p, std::move(req), std::move(region));
}

// A job for a request that passed the checks; it waits for a serve slot if none is free.
void Route::serve(Peer& p, StageRequest req, std::shared_ptr<Region> region) {
  auto owned = std::make_unique<SlotJob>();
  SlotJob& job = *owned;
  job.id = next_request_++;
  job.route = this;
  job.request = req.request;
  job.peer = &p;
  job.region = std::move(region);
  job.runs = std::move(req.runs);
  job.bytes = req.bytes;
  job.peer_base = std::move(req.base);
  job.peer_key = std::move(req.key);
  // By cma where the requester lets us and we reach it: its slot's address reaches only into
  // its own process (host_hop.cpp says why that is safe for us).
  job.peer_slot = req.slot;
  job.cma = req.slot != 0 && same_host_ && same_host_->reaches(p) && same_host_->allowed(p, req.slot);
  if (req.dir == kOwnerPulls) {
    job.write_out = false;
    job.steps[0] = Step::RmaSlot;
    job.steps[1] = Step::Unpack;
  } else {
    job.write_out = true;
    job.steps[0] = Step::Pack;
    job.steps[1] = Step::RmaSlot;
  }
  job.steps[2] = Step::Ack;
  host_.begin_work(p);
  jobs_.emplace(job.id, std::move(owned));
  ensure_slots();
  job.slot = take_slot(true);
  if (!job.slot) {
    serve_queue_.push_back(job.id);
    return;
  }
  start_job(job);
}

}  // namespace p2p::staged
