// Fences: peers asking to hear once the copies their provider queued in this process so far
// are done (shm's CUDA IPC path completes an RMA before its copy lands: route.h). Each is
// answered once the event recorded behind those copies is done.
//
// Thread: the worker's.
#pragma once

#include <cstdint>
#include <vector>

#include "core/copier.h"
#include "core/peer.h"

namespace p2p::routes::fabric {

class Fences {
 public:
  void add(core::Copier& copier, core::Peer* peer, uint64_t transfer) {
    pending_.push_back({copier.record_provider_event(), peer, transfer});
  }
  bool empty() const { return pending_.empty(); }
  // answer(peer, transfer) for each fence whose copies are done.
  template <typename Answer>
  void poll(core::Copier& copier, const Answer& answer) {
    for (size_t i = 0; i < pending_.size();) {
      Pending& f = pending_[i];
      if (f.event && !copier.event_done(f.event)) {
        ++i;
        continue;
      }
      if (f.event) copier.release_event(f.event);
      answer(f.peer, f.transfer);
      pending_[i] = pending_.back();
      pending_.pop_back();
    }
  }
  // Lets go of the events of fences never answered.
  void release(core::Copier& copier) {
    for (const Pending& f : pending_)
      if (f.event) copier.release_event(f.event);
    pending_.clear();
  }

 private:
  struct Pending {
    void* event;  // after the provider's copies (Copier::record_provider_event)
    core::Peer* peer;  // peers are never erased
    uint64_t transfer;
  };
  std::vector<Pending> pending_;
};

}  // namespace p2p::routes::fabric
