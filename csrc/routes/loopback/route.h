// Route: the loopback route, for the tests only (setting test_route, TORCH_P2P_TEST_ROUTE=1;
// off otherwise, so no user and no other test takes it). It is the worked example of
// docs/design.md, "Adding a route": a route that touches its folder, one line of the registry
// and one row of the settings table, nothing else.
//
// A transfer between host memory of two engines of one process (same host identity and pid,
// both with the route on) skips the fabric: once every region it touches is answered for, the
// initiator's worker copies the call's runs and pages with memmove on its next poll().
//
// The owner decides what a peer may reach, as on the cma route (core/grants.h): before its
// first transfer to a region, the initiator asks the owner for it and checks the handle, the
// call's access and every run against the owner's registration; the owner's region.close()
// waits for our release. Like the cma route, it trusts an answered region's memory to stay
// while the owner's engine is open: an owner engine closed during a copy, its tensor freed at
// once, is not guarded against (two engines of one test, never a user's).
//
// Owned by the worker thread: every method runs there.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "core/config.h"
#include "core/grants.h"
#include "core/route.h"

namespace p2p::loopback {

class Route final : public core::Route {
 public:
  // id: the route's index in the registry (its messages carry it); host_id: host_identity().
  Route(core::RouteHost& host, uint8_t id, const core::Config& config, std::string host_id);

  const char* name() const override { return "loopback"; }
  bool advertised() const override { return on_; }
  bool reaches(const core::EngineAddress& a, const core::RemoteRegion* region) override;
  bool take(core::Transfer& t) override;
  bool poll() override;
  bool idle() const override { return ready_.empty(); }
  void on_message(core::Peer& p, std::string_view body) override;
  void peer_failed(core::Peer& p) override;
  void release(uint64_t peer, uint64_t region) override;
  bool must_release(const core::Region& region, const core::Peer& p) override;
  void stop() override {}  // nothing of its own runs outside poll()

 private:
  bool peer_reaches(const core::EngineAddress& a, const core::RemoteRegion* region) const;
  // Queues t for poll() once every region it touches is answered; false if one is not.
  bool try_ready(core::Transfer& t);
  // Copies t's runs and pages, each checked against the owner's answers.
  Status copy(const core::Transfer& t);

  core::RouteHost& host_;
  const uint8_t id_;
  const std::string host_id_;
  const pid_t pid_;
  const bool engine_memory_;  // this engine's own memory is host memory the route may move
  const bool on_;
  core::Grants grants_;
  std::vector<core::Transfer*> ready_;    // answered: poll() copies them
  std::vector<core::Transfer*> copying_;  // poll()'s, kept for its capacity
};

}  // namespace p2p::loopback
