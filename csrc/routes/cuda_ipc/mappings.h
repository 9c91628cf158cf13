// Mappings: the CUDA IPC route's peers' storages mapped into this process, and the copies
// between them and ours (route.h says how the route uses them).
//
// Lifetime: a mapping stays while its region is live at the owner. The owner's RegionClosed
// makes the route release it once nothing of ours flows into it (release()), and the owner
// waits for that release before deregistering; a failed peer's mappings go once the copies
// queued for it are done (forget()). Several regions of one allocation share one mapping.
//
// Thread model: the worker thread only. It knows regions and byte runs, not transfers or peers.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/address.h"
#include "core/runs.h"
#include "cuda/ipc_memory.h"

namespace p2p::ipc {

class Mappings {
 public:
  explicit Mappings(std::unique_ptr<cuda::IpcMemory> memory);
  ~Mappings();

  // The export of a storage of ours, or none (with `why`).
  engine::IpcExport export_storage(void* ptr, uint64_t nbytes, std::string& why) {
    return memory_->export_storage(ptr, nbytes, why);
  }
  // Makes `region` of peer `peer` reachable (mapping it if needed). Throws an Error naming the
  // reason when it cannot be: then the peer takes the fabric.
  void map(uint64_t peer, bool same_process, const engine::RemoteRegion& region);
  bool mapped(uint64_t peer, uint64_t region) const { return regions_.count({peer, region}) > 0; }
  // Queues one transfer's runs and pages (local addresses, offsets into regions[rreg], all
  // mapped; page ids in `page_ids`) after `after`; returns a ticket for done().
  uint64_t copy(uint64_t peer, const std::vector<const engine::RemoteRegion*>& regions,
                const std::vector<engine::Run>& runs, const std::vector<engine::PageRuns>& pages,
                const std::vector<int64_t>& page_ids, bool write, void* after);
  void flush() { memory_->flush(); }  // see IpcMemory::flush
  bool done(uint64_t ticket) { return memory_->done(ticket); }
  void* mark() { return memory_->mark(); }  // see IpcMemory::mark
  std::string error(uint64_t ticket) { return memory_->error(ticket); }  // see IpcMemory::error
  // Drops a region's mapping (shared mappings go with their last region) once the copies
  // queued so far are done; forget() drops all of a peer's.
  void release(uint64_t peer, uint64_t region);
  void forget(uint64_t peer);
  // Runs the releases whose copies are done. True while any wait.
  bool poll();

  size_t mappings() const { return allocations_.size(); }

 private:
  struct Allocation {  // one mapped allocation of a peer
    void* base = nullptr;
    uint64_t size = 0;
    size_t regions = 0;
    bool own = false;  // an allocation of this process: nothing to unmap
  };
  using AllocationKey = std::pair<uint64_t, std::string>;  // peer, handle bytes
  struct Mapped {
    AllocationKey allocation;
    uint8_t* start = nullptr;  // the region's byte 0 in this process
    uint64_t bytes = 0;        // mapped from there on
  };
  void unmap(uint64_t peer, uint64_t region);

  std::unique_ptr<cuda::IpcMemory> memory_;
  std::map<AllocationKey, Allocation> allocations_;
  std::map<std::pair<uint64_t, uint64_t>, Mapped> regions_;  // (peer, region id)
  std::vector<engine::CopySpan> spans_;  // reused by copy()
  std::vector<engine::CopyPages> pages_;
  uint64_t last_ticket_ = 0;
  std::vector<std::pair<uint64_t, std::function<void()>>> deferred_;  // (ticket, release)
};

}  // namespace p2p::ipc
