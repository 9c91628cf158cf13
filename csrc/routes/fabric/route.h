// Route: the fabric route, RMA between registered memory over the rails, and user messages over
// the control channel. Last in the registry, it takes every transfer that no route before it
// took: striped into ops over the rail pairs (core/striper.h), generated in the order the
// transfers came, as the op pool and the rails' queues have room (lazy posting, core/rails.h).
//
// Two provider quirks are its own, read from the rail's provider profile (fabric/profile.h):
//  - cuda_ipc_rma (shm): an RMA of GPU memory completes before its copy lands, so such a
//    transfer is over only once the peer answers a Fence (confirm()); the peer answers once the
//    copies its provider queued before it are done (fences.h).
//  - target_progress (shm): the target serves our RMA only while it polls, so a transfer with
//    RMA in flight sends the peer a KeepPolling message now and then (waiting()).
// Both travel as the route's own messages (messages.h).
//
// Owned by the worker thread: every method runs there.
#pragma once

#include <cstdint>
#include <unordered_map>

#include "core/route.h"
#include "routes/fabric/fences.h"

namespace p2p::routes::fabric {

class Route final : public core::Route {
 public:
  // id: the route's index in the registry.
  Route(core::RouteHost& host, uint8_t id) : host_(host), id_(id) {}

  const char* name() const override { return "direct"; }
  bool advertised() const override { return false; }  // every engine has it: no flag
  bool reaches(const core::EngineAddress&, const core::RemoteRegion*) override { return true; }
  bool take(core::Transfer& t) override;
  bool poll() override;
  bool idle() const override;
  void on_message(core::Peer& p, std::string_view body) override;
  bool confirms(const core::Transfer& t) const override;
  void confirm(core::Transfer& t) override;
  void waiting(core::Transfer& t) override;
  void peer_failed(core::Peer& p) override { kept_polling_at_.erase(&p); }
  void release(uint64_t, uint64_t) override {}
  bool must_release(const core::Region&, const core::Peer&) override { return false; }
  void stop() override { fences_.release(host_.copier()); }

 private:
  // A taken transfer whose ops are not all made yet, and how far their making has come.
  struct Queued {
    core::Transfer* t = nullptr;
    uint64_t chunk = 0;     // the striper's op size for the transfer's bytes
    core::RunCursor at;  // the first byte no op moves yet
  };

  // Makes the ops (or a message's fragments) of the queued transfers, in order.
  bool generate();
  bool generate_rma(core::Transfer& t, uint64_t chunk, core::RunCursor& at);
  // A KeepPolling message to t's peer, at most one per kKeepPollingS.
  void keep_polling(core::Transfer& t);

  core::RouteHost& host_;
  const uint8_t id_;
  core::Ring<Queued> queue_;
  Fences fences_;                          // peers' Fences we answer
  std::unordered_map<const core::Peer*, double> kept_polling_at_;  // our last KeepPolling to each
};

}  // namespace p2p::routes::fabric
