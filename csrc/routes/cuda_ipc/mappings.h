// Mappings: the CUDA IPC route's peers' storages mapped into this process, and the copies
// between them and ours (route.h says how the route uses them).
//
// Lifetime: a mapping stays while its region is live at the owner. The owner's RegionClosed
// makes the route release it once nothing of ours flows into it (release()), and the owner
// waits for that release before deregistering; a failed peer's mappings go once the copies
// queued for it are done (forget()). Several regions of one legacy allocation share one
// mapping; a VMM region has its own (its allocations mapped back to back, as at the owner).
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
#include "routes/cuda_ipc/export.h"

namespace p2p::ipc {

class Mappings {
 public:
  explicit Mappings(std::unique_ptr<cuda::IpcMemory> memory);
  ~Mappings();

  // How a storage of ours is shared, or kind None (with `why`); see IpcMemory.
  cuda::Export export_storage(void* ptr, uint64_t nbytes, std::string& why) {
    return memory_->export_storage(ptr, nbytes, why);
  }
  std::vector<cuda::VmmChunk> export_vmm(uint64_t ptr, uint64_t nbytes, std::string& why) {
    return memory_->export_vmm(ptr, nbytes, why);
  }
  // Makes `region` of peer `peer`, exported as `x`, reachable (mapping it if needed): a legacy
  // export, or any export of an engine of this process. Throws an Error naming the reason when
  // it cannot be: then the peer takes the fabric.
  void map(uint64_t peer, bool same_process, const core::RemoteRegion& region, const IpcExport& x);
  // The same for a VMM export of another process, from its allocations (`chunks`: their sizes
  // and descriptors, closed here).
  void map_vmm(uint64_t peer, const core::RemoteRegion& region, const IpcExport& x,
               std::vector<cuda::VmmChunk>& chunks);
  bool mapped(uint64_t peer, uint64_t region) const { return regions_.count({peer, region}) > 0; }
  // Queues one transfer's runs and pages (local addresses, offsets into regions[rreg], all
  // mapped; page ids in `page_ids`) after `after`; returns a ticket for done().
  uint64_t copy(uint64_t peer, const std::vector<const core::RemoteRegion*>& regions,
                const std::vector<core::Run>& runs, const std::vector<core::PageRuns>& pages,
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
  using AllocationKey = std::pair<uint64_t, std::string>;  // peer, handle bytes (VMM: the region id)
  struct Mapped {
    AllocationKey allocation;
    uint8_t* start = nullptr;  // the region's byte 0 in this process
    uint64_t bytes = 0;        // mapped from there on
  };
  void unmap(uint64_t peer, uint64_t region);
  // Adds `region` to allocation `it` (just mapped, or shared), checking that it fits.
  void add(uint64_t peer, const core::RemoteRegion& region, uint64_t offset,
           std::map<AllocationKey, Allocation>::iterator it);

  std::unique_ptr<cuda::IpcMemory> memory_;
  std::map<AllocationKey, Allocation> allocations_;
  std::map<std::pair<uint64_t, uint64_t>, Mapped> regions_;  // (peer, region id)
  std::vector<core::CopySpan> spans_;  // reused by copy()
  std::vector<core::CopyPages> pages_;
  uint64_t last_ticket_ = 0;
  std::vector<std::pair<uint64_t, std::function<void()>>> deferred_;  // (ticket, release)
};

}  // namespace p2p::ipc
