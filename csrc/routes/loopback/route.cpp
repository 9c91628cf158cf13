#include "routes/loopback/route.h"

#include <unistd.h>

#include <cstring>

namespace p2p::loopback {

using core::Peer;
using core::RemoteRegion;
using core::Transfer;

Route::Route(core::RouteHost& host, uint8_t id, const core::Config& config, std::string host_id)
    : host_(host), id_(id), host_id_(std::move(host_id)), pid_(getpid()),
      engine_memory_(config.cuda_device < 0 && config.data_path != core::DataPath::Staged),
      on_(config.test_route && !host_id_.empty()),
      grants_(host, id, "loopback message", [this](const Peer& p) {
        if (on_ && p.address.host == host_id_ && p.address.pid == static_cast<uint32_t>(pid_)) return Status{};
        return Status::error(ErrorKind::Remote, "the owner's loopback route is off or the peer is in another process");
      }) {}

bool Route::reaches(const core::EngineAddress& a, const RemoteRegion* region) {
  return engine_memory_ && peer_reaches(a, region);
}

bool Route::peer_reaches(const core::EngineAddress& a, const RemoteRegion* region) const {
  if (!on_ || a.host != host_id_ || a.pid != static_cast<uint32_t>(pid_) || !(a.routes & (1u << id_))) return false;
  return !region || (region->device_type == 0 && region->on_nics);
}

bool Route::take(Transfer& t) {
  if (t.kind == core::TransferKind::Message || t.cuda_event || !peer_reaches(t.peer->address, nullptr))
    return false;
  for (const auto& r : t.local)
    if (r->cuda_device >= 0 || !r->on_nics()) return false;
  for (const auto& r : t.remote)
    if (!peer_reaches(t.peer->address, r.get())) return false;
  grants_.take(t, [&](Transfer& t) { return try_ready(t); });  // until poll() copies it
  return true;
}

bool Route::try_ready(Transfer& t) {
  if (!grants_.answered(t)) return false;
  ready_.push_back(&t);
  return true;
}

bool Route::poll() {
  if (ready_.empty()) return false;
  copying_.swap(ready_);
  for (Transfer* t : copying_) {
    if (t->reported()) {  // failed while it waited (its peer, its deadline)
      host_.done(*t, {});
      continue;
    }
    if (t->state != core::TransferState::Running) t->enter(core::TransferState::Running);
    host_.done(*t, copy(*t));
  }
  copying_.clear();
  return true;
}

Status Route::copy(const Transfer& t) {
  const bool write = t.kind == core::TransferKind::Write;
  // memmove: two engines of one process may have registered the same memory.
  return grants_.resolve(t, [&](uint8_t* local, uint64_t remote, uint64_t len) {
    uint8_t* theirs = reinterpret_cast<uint8_t*>(remote);
    if (write)
      std::memmove(theirs, local, len);
    else
      std::memmove(local, theirs, len);
  });
}

void Route::on_message(Peer& p, std::string_view body) {
  if (grants_.on_message(p, body)) grants_.resume(p, [&](Transfer& t) { return try_ready(t); });
}

// Its transfers in ready_ were reported: poll() ends them without a copy.
void Route::peer_failed(Peer& p) { grants_.peer_failed(p); }

void Route::release(uint64_t peer, uint64_t region) { grants_.release(peer, region); }

bool Route::must_release(const core::Region& region, const Peer& p) { return grants_.must_release(region, p); }

}  // namespace p2p::loopback
