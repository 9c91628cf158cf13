// Registration of storages on every rail, in pieces no larger than one registration may be
// (about 4 GiB for remote write on EFA), and deregistration once nothing uses them.
#include <rdma/fi_domain.h>

#include "common/log.h"
#include "engine/worker.h"

namespace p2p::engine {

std::shared_ptr<RemoteRegion> Worker::register_region(const RegionSpec& spec) {
  auto region = std::make_shared<Region>();
  region->id = spec.id;
  region->ptr = spec.ptr;
  region->nbytes = spec.nbytes;
  region->cuda_device = spec.cuda_device;
  region->access = spec.access;
  region->staged = region_staged(spec.cuda_device >= 0);
  region->piece_bytes = config_.piece_bytes;

  if (region->staged) {
    ensure_slots();  // peers' requests are served from slots
  } else {
    const uint64_t access = FI_READ | FI_WRITE | ((spec.access & kRemoteRead) ? FI_REMOTE_READ : 0) |
                            ((spec.access & kRemoteWrite) ? FI_REMOTE_WRITE : 0);
    try {
      for (uint64_t off = 0; off < spec.nbytes; off += region->piece_bytes) {
        const uint64_t len = std::min<uint64_t>(region->piece_bytes, spec.nbytes - off);
        for (auto& rs : rails_)
          region->mrs.push_back(rs.rail->register_memory(spec.ptr + off, len, access, spec.cuda_device));
      }
    } catch (...) {
      for (size_t k = 0; k < region->mrs.size(); ++k) rails_[k % rails_.size()].rail->deregister(region->mrs[k]);
      throw;
    }
  }
  regions_[spec.id] = region;

  auto remote = std::make_shared<RemoteRegion>();
  remote->owner = address_;
  remote->incarnation = incarnation_;
  remote->id = spec.id;
  remote->nbytes = spec.nbytes;
  remote->access = spec.access;
  remote->staged = region->staged;
  remote->device_type = spec.cuda_device >= 0 ? 1 : 0;
  remote->device_index = static_cast<int16_t>(spec.cuda_device);
  remote->piece_bytes = region->piece_bytes;
  remote->rails = static_cast<uint16_t>(rails_.size());
  for (const auto& mr : region->mrs) {
    remote->base.push_back(mr.base);
    remote->key.push_back(mr.key);
  }
  return remote;
}

void Worker::deregister_region(uint64_t id, std::shared_ptr<std::promise<void>> done) {
  auto it = regions_.find(id);
  if (it == regions_.end()) return done->set_value();
  it->second->closing = true;
  // Transfers and served requests hold the region; tick() closes its registrations once
  // they are gone.
  closing_.emplace_back(std::move(it->second), std::move(done));
  regions_.erase(it);
}

}  // namespace p2p::engine
