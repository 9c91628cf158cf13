// Region: a storage registered with this engine, as the worker knows it.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "fabric/rail.h"

namespace p2p::core {

// What a route keeps of one of our regions (Route::learn), as the route's own type.
struct RouteState {
  virtual ~RouteState() = default;
};

// Transfers hold it; so do ops orphaned by a dead peer until their provider gives them back,
// so its registrations (and the tensor, which the engine keeps until then) outlive every
// operation that may touch the memory.
struct Region : std::enable_shared_from_this<Region> {
  uint64_t id = 0;
  uint8_t* ptr = nullptr;
  uint64_t nbytes = 0;
  int cuda_device = -1;
  uint8_t access = 0;     // Access bits granted to peers
  uint64_t piece_bytes = 0;
  // [piece * rails + rail] (mr_index); none where a route keeps the region off the NICs
  // (Route::keeps_off_nics: the staged route moves its bytes through its slots).
  std::vector<fabric::MrHandle> mrs;
  bool closing = false;
  // By route id: what each route keeps of the region (null: nothing), for as long as it lives.
  std::vector<std::unique_ptr<RouteState>> routes;

  bool on_nics() const { return !mrs.empty(); }
  template <class T>
  const T* state(uint8_t route) const {
    return route < routes.size() ? static_cast<const T*>(routes[route].get()) : nullptr;
  }
  void keep(uint8_t route, std::unique_ptr<RouteState> state) {
    if (routes.size() <= route) routes.resize(route + 1u);
    routes[route] = std::move(state);
  }
};

}  // namespace p2p::core
