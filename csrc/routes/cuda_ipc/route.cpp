#include "routes/cuda_ipc/route.h"

#include <unistd.h>

#include "common/log.h"

namespace p2p::ipc {

using engine::EngineAddress;
using engine::RemoteRegion;
using engine::Transfer;

Route::Route(engine::RouteHost& host, uint8_t id, const engine::Config& config, std::string host_id)
    : host_(host), id_(id), host_id_(std::move(host_id)) {
  if (config.cuda_device < 0 || !config.ipc) return;
  if (host_id_.empty()) {
    P2P_LOG(Warn, "CUDA IPC is off: this host's identity (/proc/sys/kernel/random/boot_id) is unknown");
    return;
  }
#ifdef WITH_CUDA  // a build without CUDA has no memory to share: the route stays off
  try {
    if (auto memory = cuda::make_ipc_memory(config.cuda_device, config.ipc_copy_engine_bytes))
      mappings_ = std::make_unique<Mappings>(std::move(memory));
  } catch (const Error& e) {
    P2P_LOG(Warn, "CUDA IPC is off: ", e.what());
  }
#endif
}

Route::~Route() { stop(); }

void Route::stop() {
  copies_.clear();
  mappings_.reset();  // waits for its copies, then unmaps
}

bool Route::peer_reaches(const EngineAddress& a) const {
  return mappings_ && (a.routes & (1u << id_)) && a.host == host_id_ && !unreachable_.count(a.incarnation);
}

bool Route::map(const EngineAddress& a, const RemoteRegion& region) {
  try {
    mappings_->map(a.incarnation, a.pid == static_cast<uint32_t>(getpid()), region);
    return true;
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::Value) throw;
    unreachable_[a.incarnation] = e.what();
    P2P_LOG(Warn, "CUDA IPC to peer ", hex(a.incarnation), " is not possible (", e.what(),
            "): its transfers take the fabric");
    return false;
  }
}

bool Route::reaches(const EngineAddress& a, const RemoteRegion* region) {
  if (!peer_reaches(a)) return false;
  if (!region) return true;
  if (!region->ipc.exported() || region->incarnation != a.incarnation) return false;
  try {
    return map(a, *region);
  } catch (const Error&) {  // a handle that lies about its memory: its transfers fail
    return false;
  }
}

void Route::describe(engine::Region& region, RemoteRegion& handle) {
  if (!mappings_ || region.cuda_device < 0) return;
  std::string why;
  handle.ipc = mappings_->export_storage(region.ptr, region.nbytes, why);
  region.exported = handle.ipc.exported();
  if (!region.exported)
    P2P_LOG(Info, "region ", region.id, " is not exported for CUDA IPC (", why, "): peers reach it over the fabric");
}

// Takes t if both ends are CUDA memory of this host and every remote region maps.
bool Route::take(Transfer& t) {
  if (t.kind == engine::TransferKind::Message || !peer_reaches(t.peer->address)) return false;
  for (const auto& r : t.local)
    if (r->cuda_device < 0) return false;
  for (const auto& r : t.remote)
    if (!r->ipc.exported()) return false;
  engine::Peer& p = *t.peer;
  try {
    for (const auto& r : t.remote)
      if (!map(p.address, *r)) return false;
  } catch (const Error& e) {  // a handle that lies about its memory
    ++t.pending;
    host_.done(t, Status::error(ErrorKind::Value, e.what()));
    return true;
  }
  ++t.pending;  // until the copy is done
  host_.watch_process(p);
  std::vector<const RemoteRegion*> regions;
  for (const auto& r : t.remote) regions.push_back(r.get());
  const uint64_t ticket = mappings_->copy(p.incarnation, regions, t.runs, t.pages, t.page_ids,
                                          t.kind == engine::TransferKind::Write, t.cuda_event);
  t.enter(engine::TransferState::Running);
  copies_.push_back({ticket, &t});
  host_.started(t, id_);
  return true;
}

// A stream that follows an IPC copy waits for an event recorded after it: on the GPU only, so
// nothing it holds up can hold up the copy (a wait on a flag the host releases could).
engine::StreamOrder Route::stream_order(const Transfer&) {
  if (void* event = mappings_->mark()) return {engine::StreamOrder::Event, event};
  return {engine::StreamOrder::Future};
}

// Sends out the copies queued since the last turn in one launch, completes the transfers whose
// copies are done (in the order they were queued) and unmaps what was released.
bool Route::poll() {
  if (!mappings_) return false;
  mappings_->flush();
  mappings_->poll();
  size_t n = 0;
  while (n < copies_.size() && mappings_->done(copies_[n].first)) ++n;
  if (n == 0) return false;
  std::vector<std::pair<uint64_t, Transfer*>> ended(copies_.begin(), copies_.begin() + n);
  copies_.erase(copies_.begin(), copies_.begin() + n);
  for (auto& [ticket, t] : ended) {
    const std::string error = mappings_->error(ticket);
    host_.done(*t, error.empty() ? Status{}
                                 : Status::error(ErrorKind::Generic, cat("the CUDA IPC copy failed: ", error)));
  }
  return true;
}

void Route::peer_failed(engine::Peer& p) {
  if (mappings_) mappings_->forget(p.incarnation);  // once the copies queued for it are done
}

void Route::release(uint64_t peer, uint64_t region) {
  if (mappings_) mappings_->release(peer, region);
}

// IPC copies check nothing at our end: a peer that may have the region mapped must let go first.
bool Route::must_release(const engine::Region& region, const engine::Peer& p) {
  return region.exported && peer_reaches(p.address);
}

}  // namespace p2p::ipc
