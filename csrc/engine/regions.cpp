// Registration of storages on every rail, in pieces no larger than one registration may be
// (about 4 GiB for remote write on EFA), and deregistration once nothing uses them.
#include <rdma/fi_domain.h>

#include <algorithm>

#include "common/clock.h"
#include "common/log.h"
#include "engine/worker.h"
#include "fabric/registration.h"
#ifdef WITH_CUDA
#include "cuda/vmm.h"
#endif

namespace p2p::engine {

using namespace core;

std::shared_ptr<RemoteRegion> Worker::register_region(const RegionSpec& spec) {
  assert_on_worker();
  auto region = std::make_shared<Region>();
  region->id = regions_.next_id();
  region->ptr = spec.ptr;
  region->nbytes = spec.nbytes;
  region->cuda_device = spec.cuda_device;
  region->access = spec.access;
  region->piece_bytes = config_.piece_bytes;
  const bool off_nics = std::any_of(routes_.begin(), routes_.end(),
                                    [&](auto& r) { return r->keeps_off_nics(spec.cuda_device); });

  auto remote = std::make_shared<RemoteRegion>();
  try {
    if (!off_nics) {
      const uint64_t access = FI_READ | FI_WRITE | ((spec.access & kRemoteRead) ? FI_REMOTE_READ : 0) |
                              ((spec.access & kRemoteWrite) ? FI_REMOTE_WRITE : 0);
      try {
        rails_->register_memory(spec.ptr, spec.nbytes, region->piece_bytes, access, spec.cuda_device, region->mrs,
                                dmabuf_of(spec));
      } catch (const Error& e) {
        // data_path="direct" asked for no staging: the engine refuses it (engine_regions.cpp).
        if (!spec.vmm || config_.data_path == DataPath::Direct) throw;
        rails_->deregister(region->mrs);
        region->mrs.clear();  // off the NICs: the staged route takes it
        P2P_LOG(Info, "region ", region->id, " (CUDA VMM memory) cannot be registered with provider ",
                facts_.provider, " (", e.what(), "): other hosts reach it through the staging slots, "
                "same-host CUDA engines by IPC");
      }
    }
    for (auto& r : routes_) r->learn(*region, *spec.storage);
    remote->owner = facts_.address;
    remote->incarnation = facts_.incarnation;
    remote->id = region->id;
    remote->nbytes = spec.nbytes;
    remote->access = spec.access;
    remote->on_nics = region->on_nics();
    remote->device_type = spec.cuda_device >= 0 ? 1 : 0;
    remote->device_index = static_cast<int16_t>(spec.cuda_device);
    remote->piece_bytes = region->piece_bytes;
    remote->rails = static_cast<uint16_t>(rails_->size());
    for (const auto& mr : region->mrs) {
      remote->base.push_back(mr.base);
      remote->key.push_back(mr.key);
    }
    for (auto& r : routes_) r->describe(*region, *remote);  // what each route adds (an IPC export)
  } catch (...) {
    rails_->deregister(region->mrs);
    throw;
  }
  regions_.add(region);
  return remote;
}

// Where the provider takes GPU memory by dma-buf (fabric/registration.h), each piece's; a piece
// the driver gives none of registers by address (said once).
Rails::DmaBufOf Worker::dmabuf_of(const RegionSpec& spec) {
  const fabric::MemoryKind kind = spec.cuda_device < 0 ? fabric::MemoryKind::Host
                                  : spec.vmm           ? fabric::MemoryKind::CudaVmm
                                                       : fabric::MemoryKind::Cuda;
  const fabric::RegistrationChoice choice =
      fabric::choose_registration(fabric::profile(facts_.provider), facts_.hmem, facts_.dmabuf, kind);
  if (choice.how != fabric::Registration::DmaBuf) return nullptr;
#ifdef WITH_CUDA
  return [this](uint8_t* ptr, uint64_t len) {
    fabric::DmaBuf buf;
    uint64_t start = 0, size = 0;
    std::string why;
    buf.fd = cuda::dmabuf_fd(reinterpret_cast<uint64_t>(ptr), len, start, size, why);
    buf.base = reinterpret_cast<void*>(start);
    buf.len = size;
    if (buf.fd < 0 && !dmabuf_refused_) {
      dmabuf_refused_ = true;
      P2P_LOG(Warn, "GPU memory registers by address (FI_HMEM_CUDA, needs nvidia-peermem), not by dma-buf: ", why);
    }
    return buf;
  };
#else
  return nullptr;
#endif
}

void Worker::deregister_region(uint64_t id, std::shared_ptr<std::promise<void>> done) {
  assert_on_worker();
  const std::shared_ptr<Region> live = regions_.find(id);
  if (!regions_.close(id, std::move(done), now() + config_.peer_timeout_s)) return;
  // Every peer that knows us hears of it (its new transfers to the region fail at once) and
  // answers once none of its transfers flows into the region any more. The registrations go
  // when local operations are done; on shm (Rail::peers_must_release) only once every peer
  // has answered, or peer_timeout passed; so does a region for the peers that a route lets
  // reach it without the NICs (Route::must_release).
  const bool wait = rails_->rail(0).peers_must_release();
  peers_.each([&](Peer& p) {
    if (p.state() != PeerState::Ready) return;
    peers_.send(p, peers_.message(RegionClosed{id}, p));
    bool routed = false;
    if (live)
      for (auto& r : routes_) routed |= r->must_release(*live, p);
    if (wait || routed) regions_.must_release(id, p.incarnation);
    // A same-host peer that reached the region without the NICs may never have been a
    // destination of ours: its process is watched from now on, so that its death ends the wait
    // at once rather than after peer_timeout.
    if (routed) peers_.watch_process(p);
  });
}

// A peer deregisters one of its regions: new transfers to it fail; the release goes back once
// ours in flight are done.
void Worker::on_region_closed(Peer& p, uint64_t region) {
  p.closed_regions.insert(region);
  p.to_release.insert(region);
  release_regions(p);
}

void Worker::release_regions(Peer& p) {
  for (auto it = p.to_release.begin(); it != p.to_release.end();) {
    const uint64_t region = *it;
    const bool flowing = transfers_.any_of([&](const Transfer& t) {
      return t.peer == &p && (t.pending > 0 || t.queued) &&
             std::any_of(t.remote.begin(), t.remote.end(), [&](auto& r) { return r->id == region; });
    });
    if (flowing) {
      ++it;
      continue;
    }
    for (auto& r : routes_) r->release(p.incarnation, region);
    peers_.send(p, peers_.message(RegionReleased{region}, p));
    it = p.to_release.erase(it);
  }
}

}  // namespace p2p::engine
