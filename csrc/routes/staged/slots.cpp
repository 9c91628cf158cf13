// The staging slot pool: pinned host memory registered with every rail, half for transfers
// this engine starts, half for serving peers (staging.h says why).
#include <rdma/fi_domain.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/log.h"
#include "common/process.h"
#include "routes/staged/route.h"

namespace p2p::staged {

using namespace core;
namespace {

constexpr uint64_t kSlotAccess = FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE;

}  // namespace

void Route::ensure_slots() {
  if (!slots_.empty()) return;
  const uint64_t slot_bytes = slot_size(host_.config().slot_bytes);
  const size_t n = std::max<size_t>(2, host_.config().staging_bytes / slot_bytes);
  const uint64_t span_bytes = round_page(kMaxJobRuns * sizeof(CopySpan));
  auto* base = static_cast<uint8_t*>(host_.copier().alloc_pinned(n * (slot_bytes + span_bytes)));
  slot_memory_ = base;
  for (size_t i = 0; i < n; ++i) {
    auto slot = std::make_unique<Slot>();
    slot->ptr = base + i * slot_bytes;
    slot->bytes = slot_bytes;
    slot->spans = reinterpret_cast<CopySpan*>(base + n * slot_bytes + i * span_bytes);
    slot->serve = i >= n / 2;
    for (size_t r = 0; r < host_.rails().size(); ++r)
      slot->mrs.push_back(host_.rails().rail(r).register_memory(slot->ptr, slot_bytes, kSlotAccess, -1));
    free_slots_[slot->serve].push_back(slot.get());
    slots_.push_back(std::move(slot));
  }
  P2P_LOG(Info, "staging: ", n, " slots of ", slot_bytes, " bytes (", n - n / 2, " for serving peers)");
}

Slot* Route::take_slot(bool serve) {
  auto& free = free_slots_[serve];
  if (free.empty()) return nullptr;
  Slot* slot = free.back();
  free.pop_back();
  return slot;
}

void Route::give_slot(Slot* slot) {
  free_slots_[slot->serve].push_back(slot);
  if (!slot->serve) return;  // a transfer waiting for one takes it at the route's next poll
  while (!serve_queue_.empty() && !free_slots_[1].empty()) {
    auto it = jobs_.find(serve_queue_.front());
    serve_queue_.pop_front();
    if (it == jobs_.end()) continue;  // its peer failed while it waited
    it->second->slot = take_slot(true);
    start_job(*it->second);
  }
}

// A slot whose job failed with its peer unreachable may still be named in a peer's posted
// RMA; a new key makes the provider refuse it.
void Route::rekey(Slot& slot) {
  for (size_t r = 0; r < host_.rails().size(); ++r) {
    host_.rails().rail(r).deregister(slot.mrs[r]);
    slot.mrs[r] = host_.rails().rail(r).register_memory(slot.ptr, slot.bytes, kSlotAccess, -1);
  }
}

// A failed peer whose request let it copy with our slot (cma) may still do so while its process
// lives, whatever failed it: the slot stays out of the pool until the process has exited
// (its pidfd says so), not merely until the job ends. A process that is gone gives it back now.
void Route::hold_slot(SlotJob& job) {
  job.cma = false;  // the job itself waits no more
  const int pidfd = open_pidfd(static_cast<pid_t>(job.peer->address.pid));
  if (pidfd < 0 && errno == ESRCH) return;
  if (pidfd < 0)
    P2P_LOG(Warn, "staging: a slot stays out of the pool: peer ", hex(job.peer->incarnation), " (pid ",
            job.peer->address.pid, ") may still copy with it, and its exit cannot be watched: ", std::strerror(errno));
  else
    held_.push_back({job.slot, pidfd});
  job.slot = nullptr;
}

void Route::release_held() {
  for (size_t i = 0; i < held_.size();) {
    if (!exited(held_[i].second)) {
      ++i;
      continue;
    }
    close(held_[i].second);
    Slot* slot = held_[i].first;
    held_[i] = held_.back();
    held_.pop_back();
    give_slot(slot);
  }
}

}  // namespace p2p::staged
