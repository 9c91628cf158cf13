// RegionTable: the storages registered with this engine, by id (ids grow and are never reused,
// so a peer can tell a stale handle), and those being deregistered. A closing region goes once
// no local operation holds it and every peer that had to release it has released it, or the
// release deadline has passed (a peer that neither answers nor dies within peer_timeout is not
// waited for). The table decides when; the worker registers, deregisters and sends the
// messages. Worker thread only.
#pragma once

#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "core/messages.h"
#include "core/region.h"

namespace p2p::core {

class RegionTable {
 public:
  using Waiter = std::shared_ptr<std::promise<void>>;
  using Deregister = std::function<void(Region&)>;

  uint64_t next_id() { return ++last_id_; }
  void add(std::shared_ptr<Region> region) { live_[region->id] = std::move(region); }
  // The live region `id` (not closing), or null.
  std::shared_ptr<Region> find(uint64_t id) const {
    auto it = live_.find(id);
    return it == live_.end() ? nullptr : it->second;
  }
  // Starts closing `id`, answering `done` when it is gone; false if `id` is not live (then
  // `done` joins a close under way, or is answered at once).
  bool close(uint64_t id, Waiter done, double deadline);
  // The region closing as `id` waits for `peer`'s release; released() is that release.
  void must_release(uint64_t id, uint64_t peer);
  void released(uint64_t id, uint64_t peer);
  // A peer that is gone releases everything.
  void forget_peer(uint64_t peer);
  // Deregisters the closings that are over and answers their waiters.
  void finish(double now, const Deregister& deregister);
  // At shutdown: answers every waiter and deregisters every live region.
  void clear(const Deregister& deregister);
  // What a peer learns of our regions when we introduce ourselves: the last id handed out and
  // the ranges of ids still registered, so that a handle to a region deregistered before the
  // peer connected is refused before its first RMA (see Peer::region_gone). NOTE: shm writes
  // by CMA straight into our memory and checks no key: without this a stale handle would land
  // in memory the user reuses.
  LiveRegions live() const;

  size_t closing() const { return closing_.size(); }

 private:
  struct Closing {
    std::shared_ptr<Region> region;
    std::vector<Waiter> waiters;
    std::unordered_set<uint64_t> unreleased;  // peer incarnations
    double deadline = 0;
  };
  std::unordered_map<uint64_t, std::shared_ptr<Region>> live_;
  uint64_t last_id_ = 0;
  std::vector<Closing> closing_;
};

}  // namespace p2p::core
