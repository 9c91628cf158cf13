#include "routes/fabric/route.h"

#include <algorithm>

#include "common/clock.h"
#include "common/counters.h"
#include "routes/fabric/messages.h"

namespace p2p::routes::fabric {

using core::Transfer;
using core::TransferKind;
using core::TransferState;

bool Route::take(Transfer& t) {
  t.pages_to_runs();
  uint64_t chunk = 0;
  if (t.kind != TransferKind::Message) {
    uint64_t total = 0;
    for (const core::Run& r : t.runs) total += r.len;
    core::Rails& rails = host_.rails();
    chunk = rails.striper().chunk(total, core::Striper::pairs(rails.size(), t.peer->remote_rails()));
  }
  ++t.pending;  // until its ops are all made (generate())
  host_.started(t, id_);
  t.enter(TransferState::Queued);
  t.queued = true;
  queue_.push_back({&t, chunk, {}});
  return true;
}

bool Route::poll() {
  fences_.poll(host_.copier(), [this](core::Peer* p, uint64_t transfer) {
    if (!p->failed()) host_.send(*p, id_, write_message({kFenceAck, transfer}));
  });
  return generate();
}

// Nothing wakes the worker when the caller's stream event or a fence's copies complete.
bool Route::idle() const { return fences_.empty() && (queue_.empty() || !queue_.front().t->cuda_event); }

bool Route::generate() {
  bool any = false;
  while (!queue_.empty()) {
    Transfer& t = *queue_.front().t;
    if (t.reported()) {
      queue_.pop_front();
      t.queued = false;
      host_.done(t, {});
      continue;
    }
    // RMA must not read memory before the caller's stream has written it.
    if (t.cuda_event && !host_.copier().event_done(t.cuda_event)) break;
    any = true;
    if (t.kind == TransferKind::Message) {
      host_.send_user_message(t);
    } else {
      Queued q = queue_.front();  // a copy: its reference would not outlive a push meanwhile
      const bool all = generate_rma(t, q.chunk, q.at);
      queue_.front().at = q.at;
      if (!all) break;  // out of ops or queue room: next turn, in the queue's order
    }
    queue_.pop_front();
    t.queued = false;
    t.enter(TransferState::Running);
    host_.done(t, {});  // may free t
  }
  return any;
}

bool Route::generate_rma(Transfer& t, uint64_t chunk, core::RunCursor& at) {
  core::Rails& rails = host_.rails();
  const size_t L = rails.size(), R = t.peer->remote_rails();
  auto local = [&](uint32_t i) { return core::Extent{reinterpret_cast<uint64_t>(t.local[i]->ptr), t.local[i]->piece_bytes}; };
  auto remote = [&](uint32_t i) { return core::Extent{0, t.remote[i]->piece_bytes}; };
  return rails.generate(
      *t.peer, t.kind == TransferKind::Write ? core::OpKind::Write : core::OpKind::Read, &t,
      [&] { return !at.at_end(t.runs); },
      [&](core::Op& op, const core::RailPair& pair) {
        core::Segment segs[core::kMaxIov];
        const size_t max_iov = std::min(rails.rail(pair.local).max_iov(), core::kMaxIov);
        const size_t n = core::Striper::fill(at, t.runs, local, remote, chunk, max_iov, segs);
        for (size_t i = 0; i < n; ++i) {
          const core::Segment& s = segs[i];
          const core::Run& run = t.runs[s.run];
          const core::Region& lr = *t.local[run.lreg];
          const core::RemoteRegion& rr = *t.remote[run.rreg];
          const size_t rkey = core::mr_index(s.rpiece, R, pair.remote);
          op.region = t.local[run.lreg].get();
          op.device = lr.cuda_device >= 0;
          op.add(reinterpret_cast<uint8_t*>(run.local + s.offset), s.len,
                 lr.mrs[core::mr_index(s.lpiece, L, pair.local)].desc, rr.base[rkey] + s.rpiece_offset, rr.key[rkey]);
        }
        ++t.pending;
      });
}

void Route::on_message(core::Peer& p, std::string_view body) {
  const Message m = read_message(body);
  if (m.kind == kFence) fences_.add(host_.copier(), &p, m.transfer);
  if (m.kind == kFenceAck) host_.acknowledged(p, m.transfer);
  // kKeepPolling: its arrival was the point
}

// NOTE: shm's CUDA IPC path (libfabric 2.6) completes an RMA once the target has queued its
// cudaMemcpy, which CUDA runs asynchronously for device-to-device copies. On the GPU
// machine, 256 MiB at a time, 25-58% of a read has landed at its completion, and a writer
// reusing its buffer at once changes 28-77% of what the target gets (libfabric issue 11231).
// So the transfer completes only when the peer answers a Fence, which it does once the copies
// its provider queued before it are done; the Fence comes after the RMA in the peer's command
// queue.
bool Route::confirms(const Transfer& t) const {
  if (t.kind == TransferKind::Message || !host_.rails().rail(0).cuda_ipc()) return false;
  if (t.runs.empty()) return false;  // nothing was written
  return std::any_of(t.local.begin(), t.local.end(), [](const auto& r) { return r->cuda_device >= 0; });
}

void Route::confirm(Transfer& t) {
  count(Counter::Fences);
  host_.send(*t.peer, id_, write_message({kFence, t.id}));
}

void Route::waiting(Transfer& t) {
  if (t.kind != TransferKind::Message && host_.rails().rail(0).target_progress()) keep_polling(t);
}

// Profile::target_progress (shm): an idle target naps 50-100 us between polls and nothing wakes
// it when our RMA arrives, while a message does keep it polling for its spin_us (1 ms unless
// set). Its reads run one at a time through bounce buffers, each taking steps of both sides:
// 256 random 4 KiB pages took 13 ms to read napping, about 1 ms polling.
void Route::keep_polling(Transfer& t) {
  constexpr double kKeepPollingS = 200e-6;
  core::Peer& p = *t.peer;
  if (p.failed() || p.waits()) return;
  const double at = now();
  double& last = kept_polling_at_[&p];
  if (at - last < kKeepPollingS) return;
  last = at;
  host_.send(p, id_, write_message({kKeepPolling}));
}

}  // namespace p2p::routes::fabric
