#include "routes/cuda_ipc/mappings.h"

#include "common/error.h"
#include "common/log.h"

namespace p2p::ipc {

Mappings::Mappings(std::unique_ptr<cuda::IpcMemory> memory) : memory_(std::move(memory)) {}

Mappings::~Mappings() {
  memory_->done(last_ticket_);  // the memory's destructor waits for the stream
  for (auto& [key, a] : allocations_)
    if (!a.own) memory_->close(a.base);
  memory_.reset();
}

void Mappings::map(uint64_t peer, bool same_process, const core::RemoteRegion& region, const IpcExport& x) {
  if (auto known = regions_.find({peer, region.id}); known != regions_.end()) {
    // The same region through another handle (views share one; a tampered one may not).
    P2P_CHECK(region.nbytes <= known->second.bytes, ErrorKind::Value, "region ", region.id, " of peer ", hex(peer),
              " claims ", region.nbytes, " bytes; its mapping holds ", known->second.bytes);
    return;
  }
  P2P_CHECK(x.shared.kind != cuda::Export::None, ErrorKind::Value, "region ", region.id, " is not exported for CUDA IPC");
  // A legacy handle names its allocation, which several regions may share; a VMM region is
  // mapped on its own.
  const AllocationKey key{peer, x.shared.kind == cuda::Export::Legacy ? x.shared.handle : std::to_string(region.id)};
  auto it = allocations_.find(key);
  if (it == allocations_.end()) {
    Allocation a;
    if (same_process) {
      // An engine of this process owns it: its pointer works as it is.
      P2P_CHECK(memory_->owns(x.ptr, region.nbytes), ErrorKind::Value, "region ", region.id,
                " names memory this process does not have");
      a.base = reinterpret_cast<void*>(x.ptr - x.shared.offset);
      a.size = x.shared.offset + region.nbytes;
      a.own = true;
    } else {
      P2P_CHECK(x.shared.kind == cuda::Export::Legacy, ErrorKind::Generic, "region ", region.id,
                " is VMM memory, mapped from its owner's descriptors only");
      a.base = memory_->open(x.shared.handle, a.size);
    }
    it = allocations_.emplace(key, a).first;
  }
  add(peer, region, x.shared.offset, it);
}

void Mappings::map_vmm(uint64_t peer, const core::RemoteRegion& region, const IpcExport& x,
                       std::vector<cuda::VmmChunk>& chunks) {
  Allocation a;
  a.base = memory_->open_vmm(chunks, a.size);
  add(peer, region, x.shared.offset, allocations_.emplace(AllocationKey{peer, std::to_string(region.id)}, a).first);
}

void Mappings::add(uint64_t peer, const core::RemoteRegion& region, uint64_t offset,
                   std::map<AllocationKey, Allocation>::iterator it) {
  Allocation& a = it->second;
  // A handle that claims more than its allocation holds would let a copy fault the GPU.
  if (const uint64_t size = a.size; offset > size || region.nbytes > size - offset) {
    if (a.regions == 0) {
      if (!a.own) memory_->close(a.base);
      allocations_.erase(it);
    }
    P2P_THROW(ErrorKind::Value, "region ", region.id, " of peer ", hex(peer), " claims ", region.nbytes,
              " bytes at offset ", offset, " of an allocation of ", size);
  }
  ++a.regions;
  regions_[{peer, region.id}] = {it->first, static_cast<uint8_t*>(a.base) + offset, a.size - offset};
}

uint64_t Mappings::copy(uint64_t peer, const std::vector<const core::RemoteRegion*>& regions,
                     const std::vector<core::Run>& runs, const std::vector<core::PageRuns>& pages,
                     const std::vector<int64_t>& page_ids, bool write, void* after) {
  std::vector<uint8_t*> starts;
  for (const core::RemoteRegion* r : regions) starts.push_back(regions_.at({peer, r->id}).start);
  spans_.clear();
  for (const core::Run& run : runs) {
    void* local = reinterpret_cast<void*>(run.local);
    void* remote = starts[run.rreg] + run.remote;
    spans_.push_back(write ? core::CopySpan{remote, local, run.len} : core::CopySpan{local, remote, run.len});
  }
  pages_.clear();
  for (const core::PageRuns& p : pages) {
    void* local = reinterpret_cast<void*>(p.local);
    void* remote = starts[p.rreg] + p.remote;
    const int64_t* lids = page_ids.data() + p.first;
    const int64_t* rids = lids + p.n;
    pages_.push_back(write ? core::CopyPages{remote, local, p.remote_stride, p.local_stride, rids, lids, p.bytes, p.n}
                           : core::CopyPages{local, remote, p.local_stride, p.remote_stride, lids, rids, p.bytes, p.n});
  }
  last_ticket_ = memory_->copy(spans_, pages_, after);
  return last_ticket_;
}

void Mappings::release(uint64_t peer, uint64_t region) {
  if (!mapped(peer, region)) return;
  deferred_.push_back({last_ticket_, [this, peer, region] { unmap(peer, region); }});
  poll();
}

void Mappings::forget(uint64_t peer) {
  std::vector<uint64_t> ids;
  for (auto it = regions_.lower_bound({peer, 0}); it != regions_.end() && it->first.first == peer; ++it)
    ids.push_back(it->first.second);
  for (uint64_t id : ids) release(peer, id);
}

void Mappings::unmap(uint64_t peer, uint64_t region) {
  auto it = regions_.find({peer, region});
  if (it == regions_.end()) return;
  auto a = allocations_.find(it->second.allocation);
  regions_.erase(it);
  if (--a->second.regions > 0) return;
  if (!a->second.own) memory_->close(a->second.base);
  P2P_LOG(Debug, "unmapped an allocation of peer ", hex(peer));
  allocations_.erase(a);
}

bool Mappings::poll() {
  size_t kept = 0;
  for (auto& d : deferred_) {
    if (memory_->done(d.first)) {
      d.second();
    } else {
      deferred_[kept++] = std::move(d);
    }
  }
  deferred_.resize(kept);
  return kept > 0;
}

}  // namespace p2p::ipc
