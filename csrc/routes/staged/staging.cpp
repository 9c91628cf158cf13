#include "routes/staged/staging.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "common/log.h"
#include "routes/staged/route.h"

namespace p2p::staged {

void SlotJob::op_done(core::RouteHost&, core::Op&, const Status& status) { route->job_op_done(*this, status); }

const char* name(SlotJobState state) {
  switch (state) {
    case SlotJobState::Ready: return "Ready";
    case SlotJobState::Copying: return "Copying";
    case SlotJobState::Copied: return "Copied";
    case SlotJobState::Generating: return "Generating";
    case SlotJobState::Moving: return "Moving";
    case SlotJobState::Requesting: return "Requesting";
  }
  return "?";
}

using namespace core;

Route::Route(RouteHost& host, uint8_t id, PeerCopies* same_host)
    : host_(host), id_(id), same_host_(same_host),
      grants_(
          host, id, "staged message",
          [this](const Peer& p) {
            return same_host_ && same_host_->reaches(p)
                       ? Status{}
                       : Status::error(ErrorKind::Remote, "the owner does not reach this peer by cma");
          },
          [this](Peer& p, const Region&) {
            same_host_->consent(p);  // p copies into the region
            return std::string();
          }) {}

size_t Route::request_run_limit() const {
  // Header, the route message's id and length, the request's fixed fields, one (base, key) per
  // local rail, then its runs.
  const size_t fixed = kHeaderBytes + 1 + 4 + StageRequest::kFixedBytes + StageRequest::kPerRail * host_.rails().size();
  return std::min(kMaxJobRuns, (kMessageBytes - fixed) / StageRequest::kPerRun);
}

// After the worker's rails are closed (stop() let go of the slots' registrations).
Route::~Route() {
  jobs_.clear();
  for (auto& [slot, pidfd] : held_) close(pidfd);
  if (slot_memory_) host_.copier().free_pinned(slot_memory_);
}

void Route::stop() {
  for (auto& slot : slots_) {
    for (size_t r = 0; r < slot->mrs.size(); ++r) host_.rails().rail(r).deregister(slot->mrs[r]);
    slot->mrs.clear();
  }
}

// GPU memory the NICs cannot register, and any memory with data_path="staged".
bool Route::keeps_off_nics(int cuda_device) const {
  return host_.config().data_path == DataPath::Staged || (cuda_device >= 0 && !host_.hmem());
}

// Transfers of this engine's memory to `a` take the route if either end is off the NICs.
bool Route::reaches(const EngineAddress&, const RemoteRegion* region) {
  return keeps_off_nics(host_.config().cuda_device) || (region && !region->on_nics);
}

void Route::describe(Region& region, RemoteRegion&) {
  if (!region.on_nics()) ensure_slots();  // peers' requests are served from slots
}

// ---------------------------------------------------------------------------------------------
// Initiator side.

bool Route::take(Transfer& t) {
  if (t.kind == TransferKind::Message) return false;
  const bool staged = std::any_of(t.local.begin(), t.local.end(), [](auto& r) { return !r->on_nics(); }) ||
                      std::any_of(t.remote.begin(), t.remote.end(), [](auto& r) { return !r->on_nics; });
  if (!staged) return false;
  t.pages_to_runs();
  ++t.pending;  // until every job of it is made (generate())
  host_.started(t, id_);
  t.enter(TransferState::Queued);
  if (!runs_by_cma(t))
    queue_.push_back({&t, {}});
  else if (!queue_by_cma(t))
    grants_.wait(t);  // on_message queues it
  return true;
}

bool Route::poll() {
  poll_copies();
  return generate();
}

// Jobs' ops first: they hold slots, and finishing them frees slots for the transfers behind.
bool Route::generate() {
  bool any = false;
  while (!job_gen_queue_.empty()) {
    SlotJob& job = *job_gen_queue_.front();
    if (!generate_job_ops(job)) break;
    job_gen_queue_.pop_front();
    any = true;
    if (job.ops_left == 0) advance(job);
  }
  while (!queue_.empty()) {
    Queued q = queue_.front();  // a copy: its reference would not outlive a push meanwhile
    Transfer& t = *q.t;
    const bool made = t.reported() || make_jobs(t, q.at);
    queue_.front().at = q.at;
    if (!made) break;  // waits for a slot, ahead of newer transfers
    queue_.pop_front();
    by_cma_.erase(&t);
    any = true;
    if (!t.reported()) t.enter(TransferState::Running);
    host_.done(t, {});  // every job is made (or t ended while it waited)
  }
  return any;
}

bool Route::make_jobs(Transfer& t, RunCursor& at) {
  ensure_slots();
  const bool write = t.kind == TransferKind::Write;
  while (!at.at_end(t.runs)) {
    Slot* slot = take_slot(false);
    if (!slot) return false;
    auto owned = std::make_unique<SlotJob>();
    SlotJob& job = *owned;
    job.id = next_request_++;
    job.route = this;
    job.transfer = &t;
    job.peer = t.peer;
    job.slot = slot;
    const bool remote_staged = !t.remote[t.runs[at.run].rreg]->on_nics;
    const size_t max_runs = remote_staged ? request_run_limit() : kMaxJobRuns;
    job.bytes = Striper::fill_slot(at, t.runs, max_runs, slot->bytes, job.runs);
    if (remote_staged) {
      // The owner may copy with our slot, where we let its process.
      job.cma = same_host_ && same_host_->reaches(*t.peer) && same_host_->consent(*t.peer);
      job.steps[0] = write ? Step::Pack : Step::Request;
      job.steps[1] = write ? Step::Request : Step::Unpack;
    } else {
      job.cma = by_cma_.count(&t) > 0;
      job.write_out = write;
      job.steps[0] = write ? Step::Pack : Step::RmaRuns;
      job.steps[1] = write ? Step::RmaRuns : Step::Unpack;
    }
    ++t.pending;
    jobs_.emplace(job.id, std::move(owned));
    start_job(job);
  }
  return true;
}

void Route::send_request(SlotJob& job) {
  Transfer& t = *job.transfer;
  StageRequest req;
  req.request = job.id;
  req.dir = t.kind == TransferKind::Write ? kOwnerPulls : kOwnerPushes;
  req.region_id = t.remote[job.runs[0].rreg]->id;
  req.bytes = job.bytes;
  for (const auto& mr : job.slot->mrs) {
    req.base.push_back(mr.base);
    req.key.push_back(mr.key);
  }
  if (job.cma) {
    req.slot = reinterpret_cast<uint64_t>(job.slot->ptr);
    host_.watch_process(*job.peer);  // its exit gives the slot back at once (hold_slot)
  }
  req.runs = job.runs;
  ByteWriter w;
  req.write(w);
  host_.send(*job.peer, id_, std::move(w.str()));
}

void Route::on_stage_ack(const StageAck& m) {
  auto it = jobs_.find(m.id);
  if (it == jobs_.end() || !it->second->transfer || it->second->step() != Step::Request) return;
  SlotJob& job = *it->second;
  if (m.kind != ErrorKind::None && job.status.ok())
    job.status = Status::error(ErrorKind::Remote, cat("the owner refused: ", m.message));
  job.next_step();
  advance(job);
}

// ---------------------------------------------------------------------------------------------
// Both sides: the step machine.

void Route::start_job(SlotJob& job) {
  job.cur = 0;
  job.state = SlotJobState::Ready;
  advance(job);
}

// Host runs are copied here and now; GPU runs go to the copier's stream. Returns its ticket,
// or 0 (always done) when there was nothing for the GPU.
uint64_t Route::start_copy(SlotJob& job, bool pack) {
  Slot& slot = *job.slot;
  size_t n = 0;
  uint64_t offset = 0;
  for (const Run& run : job.runs) {
    const Region& region = job.transfer ? *job.transfer->local[run.lreg] : *job.region;
    auto* mem = reinterpret_cast<uint8_t*>(run.local);
    uint8_t* in_slot = slot.ptr + offset;
    offset += run.len;
    if (region.cuda_device < 0) {
      std::memcpy(pack ? in_slot : mem, pack ? mem : in_slot, run.len);
      continue;
    }
    slot.spans[n++] = pack ? CopySpan{in_slot, mem, run.len} : CopySpan{mem, in_slot, run.len};
  }
  if (n == 0) return 0;
  return host_.copier().copy(slot.spans, n, job.transfer ? job.transfer->cuda_event : nullptr);
}

void Route::advance(SlotJob& job) {
  while (true) {
    if (job.status.ok() && job.transfer && job.transfer->reported())
      job.status = Status::error(ErrorKind::Cancelled, "the transfer ended");
    if (!job.status.ok()) {
      // Give up only once nothing in flight still uses the slot.
      if (job.in_flight()) return;
      return finish_job(job);
    }
    if (job.step() == Step::Done) return finish_job(job);
    if (run_step(job))
      job.next_step();
    else if (job.status.ok())
      return;  // waits for a copy, ops, an answer or room
  }
}

// Begins or continues the job's current step; true once the step is complete.
bool Route::run_step(SlotJob& job) {
  switch (job.step()) {
    case Step::Pack:
    case Step::Unpack:
      return run_copy(job);
    case Step::RmaRuns:
    case Step::RmaSlot:
      if (job.state == SlotJobState::Ready && job.cma) {
        copy_by_cma(job);
      } else if (job.state == SlotJobState::Ready) {
        job.state = SlotJobState::Generating;
        job.gen = {};
        job.gen_slot = 0;
        job_gen_queue_.push_back(&job);
      }
      return job.state == SlotJobState::Moving && job.ops_left == 0;
    case Step::Request:
      if (job.state == SlotJobState::Ready) {
        job.state = SlotJobState::Requesting;
        send_request(job);
      }
      return false;
    case Step::Ack:
      send_ack(*job.peer, job.request, Status{});
      return true;
    case Step::Done:
      break;
  }
  return false;
}

// A pack or unpack: started on the first call, complete once the copier is done with it.
bool Route::run_copy(SlotJob& job) {
  if (job.state == SlotJobState::Ready) {
    job.ticket = start_copy(job, job.step() == Step::Pack);
    job.state = SlotJobState::Copied;
    if (!host_.copier().done(job.ticket)) {
      job.state = SlotJobState::Copying;
      copying_.push_back(&job);  // poll_copies comes back
    }
  }
  if (job.state == SlotJobState::Copying) return false;
  if (const std::string err = host_.copier().error(); !err.empty()) {
    job.status = Status::error(ErrorKind::Generic, cat("staging copy failed: ", err));
    return false;
  }
  return true;
}

bool Route::generate_job_ops(SlotJob& job) {
  if (!job.status.ok()) {
    job.state = SlotJobState::Moving;
    return true;
  }
  Peer& p = *job.peer;
  const size_t R = p.remote_rails();
  const uint64_t chunk = host_.rails().striper().chunk(job.bytes, Striper::pairs(host_.rails().size(), R));
  // The local side is the slot, one registration; the remote side is the requester's slot
  // (serving) or the runs of a directly registered region.
  const bool to_slot = job.step() == Step::RmaSlot;
  const Run whole_slot{0, 0, job.bytes, 0, 0};
  const RunView runs = to_slot ? RunView(&whole_slot, 1) : RunView(job.runs);
  auto remote = [&](uint32_t i) { return to_slot ? Extent{} : Extent{0, job.transfer->remote[i]->piece_bytes}; };
  const bool made = host_.rails().make_ops(
      p, job.write_out ? OpKind::Write : OpKind::Read, &job, [&] { return !job.gen.at_end(runs); },
      [&](Op& op, const RailPair& pair) {
        Segment s{};
        Striper::fill(job.gen, runs, [](uint32_t) { return Extent{}; }, remote, chunk, 1, &s);
        uint64_t remote_addr, key;
        if (to_slot) {
          remote_addr = job.peer_base[pair.remote] + s.offset;
          key = job.peer_key[pair.remote];
        } else {
          const RemoteRegion& rr = *job.transfer->remote[runs[s.run].rreg];
          remote_addr = rr.base[mr_index(s.rpiece, R, pair.remote)] + s.rpiece_offset;
          key = rr.key[mr_index(s.rpiece, R, pair.remote)];
        }
        op.add(job.slot->ptr + job.gen_slot, s.len, job.slot->mrs[pair.local].desc, remote_addr, key);
        ++job.ops_left;
        job.gen_slot += s.len;
      });
  if (!made) return false;
  job.state = SlotJobState::Moving;
  return true;
}

void Route::job_op_done(SlotJob& job, const Status& status) {
  P2P_ASSERT(job.ops_left > 0);
  --job.ops_left;
  if (!status.ok() && job.status.ok()) job.status = status;
  if (job.state == SlotJobState::Moving && job.ops_left == 0) advance(job);
}

void Route::poll_copies() {
  for (size_t i = 0; i < copying_.size();) {
    SlotJob* job = copying_[i];
    if (!host_.copier().done(job->ticket)) {
      ++i;
      continue;
    }
    copying_[i] = copying_.back();
    copying_.pop_back();
    job->state = SlotJobState::Copied;
    advance(*job);
  }
}

void Route::finish_job(SlotJob& job) {
  const uint64_t id = job.id;
  Slot* slot = job.slot;
  const ErrorKind kind = job.status.kind;
  if (job.transfer) {
    host_.transfer_op_done(*job.transfer, job.status);  // a job is one pending unit of its transfer
  } else {
    if (!job.status.ok()) send_ack(*job.peer, job.request, job.status);
    host_.end_work(*job.peer);
  }
  jobs_.erase(id);
  if (slot) {
    if (kind == ErrorKind::Peer || kind == ErrorKind::Timeout || kind == ErrorKind::Cancelled) rekey(*slot);
    give_slot(slot);
  }
}

void Route::peer_failed(Peer& p) {
  std::vector<uint64_t> ids;
  for (auto& [id, job] : jobs_)
    if (job->peer == &p) ids.push_back(id);
  for (uint64_t id : ids) {
    auto it = jobs_.find(id);
    if (it == jobs_.end()) continue;
    SlotJob& job = *it->second;
    if (job.status.ok()) job.status = p.failure;
    if (job.state == SlotJobState::Requesting && job.cma) hold_slot(job);
    if (!job.slot) {
      finish_job(job);  // a request still waiting for a serve slot
      continue;
    }
    advance(job);
  }
  grants_.peer_failed(p);
}

// A job waiting for the owner's answer learns of its transfer's end (timeout, cancel) here; held
// slots come back once their peer's process has exited.
void Route::tick() {
  release_held();
  std::vector<uint64_t> ids;
  for (auto& [id, job] : jobs_)
    if (job->transfer && job->transfer->reported() && job->step() == Step::Request) ids.push_back(id);
  for (uint64_t id : ids) {
    auto it = jobs_.find(id);
    if (it != jobs_.end()) advance(*it->second);
  }
}

}  // namespace p2p::staged
