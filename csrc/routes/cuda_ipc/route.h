// Route: the same-host CUDA IPC route. A transfer between CUDA memory of two engines on one
// host (boot id and pid namespace alike, both CUDA engines with IPC on) skips the fabric: the
// initiator maps the owner's exported storage once (cached per region, mappings.h) and moves
// the whole call with one queued copy (a gather kernel for small runs, the copy engines for
// large ones) on its own stream, after the caller's stream event. A stream that follows the
// transfer waits on an event recorded after the copy, on the GPU only. The transfer completes
// once the copy's ticket is done.
//
// The owner exports each CUDA storage as it is registered (describe()): the handle carries the
// export. A peer whose storage cannot be mapped (no P2P between the GPUs, no IPC namespace in
// common) is logged once and its transfers take the fabric.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/config.h"
#include "core/route.h"
#include "routes/cuda_ipc/mappings.h"

namespace p2p::ipc {

class Route final : public engine::Route {
 public:
  // id: the route's index in the registry; host_id: host_identity().
  Route(engine::RouteHost& host, uint8_t id, const engine::Config& config, std::string host_id);
  ~Route() override;

  const char* name() const override { return "ipc"; }
  bool advertised() const override { return mappings_ != nullptr; }
  bool reaches(const engine::EngineAddress& a, const engine::RemoteRegion* region) override;
  void describe(engine::Region& region, engine::RemoteRegion& handle) override;
  bool take(engine::Transfer& t) override;
  engine::StreamOrder stream_order(const engine::Transfer& t) override;
  bool poll() override;
  bool idle() const override { return copies_.empty(); }
  void on_message(engine::Peer&, std::string_view) override {}
  void peer_failed(engine::Peer& p) override;
  void release(uint64_t peer, uint64_t region) override;
  bool must_release(const engine::Region& region, const engine::Peer& p) override;
  void stop() override;

 private:
  bool peer_reaches(const engine::EngineAddress& a) const;
  // Maps `region` of peer `a`; false (said once) where the peer cannot be mapped at all.
  // Throws the Value error of a handle that lies about its memory.
  bool map(const engine::EngineAddress& a, const engine::RemoteRegion& region);

  engine::RouteHost& host_;
  const uint8_t id_;
  const std::string host_id_;
  std::unique_ptr<Mappings> mappings_;  // null where the route is off
  std::vector<std::pair<uint64_t, engine::Transfer*>> copies_;  // (ticket, transfer), in order
  std::unordered_map<uint64_t, std::string> unreachable_;        // peers whose mapping failed: why
};

}  // namespace p2p::ipc
