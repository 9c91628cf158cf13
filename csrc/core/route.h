// Route: a way for a transfer's bytes to move other than the fabric's RMA, owned by the worker
// and kept in its own folder under csrc/routes/ with its own state. The worker offers each
// transfer to its routes in turn (routes/registry.h) before the fabric; a route that takes it
// owns its bytes until it calls RouteHost::done().
//
// A route reaches back into the worker only through RouteHost: its peers' control channel,
// transfer start and completion, the fabric fallback, region lookup, process watching and the
// worker's wake-up. Every method runs on the worker thread, except RouteHost::wake(), which any
// thread may call.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "common/error.h"
#include "core/address.h"
#include "core/peer.h"
#include "core/region.h"
#include "core/transfer.h"

namespace p2p::engine {

// What a CUDA stream must wait on to follow a transfer (Engine::stream_wait).
struct StreamOrder {
  enum Kind : uint8_t {
    Done,    // it has ended: nothing to wait for
    Event,   // its copy is queued on the GPU: `event` (recorded after it) is done when the bytes are
    Future,  // only its future says when it ends
  } kind = Done;
  void* event = nullptr;  // a pooled cudaEvent_t; the caller recycles it
};

class RouteHost {
 public:
  virtual ~RouteHost() = default;
  // Sends `body` to the same route of peer `p` (its Route::on_message).
  virtual void send(Peer& p, uint8_t route, std::string body) = 0;
  // t is route `route`'s from now on (its work counted in t.pending): marks it so and answers
  // the streams waiting on its order (Route::stream_order). Before anything may finish t.
  virtual void started(Transfer& t, uint8_t route) = 0;
  // One unit of work the route counted in t.pending is over, with its final status (a
  // failure here is the transfer's answer: no check of the peer follows); t may be gone after.
  virtual void done(Transfer& t, const Status& status) = 0;
  // The route cannot move t after all: it goes to the fabric (t.pending as it was given).
  virtual void fall_back(Transfer& t) = 0;
  virtual void fail_peer(Peer& p, Status why) = 0;
  // The live (not closing) region of ours with this id, or null.
  virtual std::shared_ptr<Region> region(uint64_t id) const = 0;
  // Fails p's transfers as soon as its process exits (same host only).
  virtual void watch_process(Peer& p) = 0;
  // Ends the worker's sleep, if it sleeps: from any thread.
  virtual void wake() = 0;
};

class Route {
 public:
  virtual ~Route() = default;
  // What engine.route() calls it.
  virtual const char* name() const = 0;
  // The flag this engine's address advertises: peers use the route only if both ends do.
  virtual bool advertised() const = 0;
  // Whether transfers of this engine's memory to `a`'s (to `region`, if given) take this route.
  // Deciding may prepare the route for it (map the region).
  virtual bool reaches(const EngineAddress& a, const RemoteRegion* region) = 0;
  // A region of ours was registered: adds to its handle what peers need to reach it here.
  virtual void describe(Region& region, RemoteRegion& handle) {}
  // Takes t (its peer is ready, its handles checked), counts its work in t.pending and calls
  // RouteHost::started; false leaves it to the next route or the fabric.
  virtual bool take(Transfer& t) = 0;
  // What a stream that follows t, a transfer of this route, waits on.
  virtual StreamOrder stream_order(const Transfer& t) { return {StreamOrder::Future}; }
  // Makes progress; true if anything happened.
  virtual bool poll() = 0;
  // True when nothing needs polling: the worker may sleep (wake() ends the sleep).
  virtual bool idle() const = 0;
  // A message from the same route of peer `p`.
  virtual void on_message(Peer& p, std::string_view body) = 0;
  // Peer `p` failed: its transfers were failed; the route lets go of its state for them.
  virtual void peer_failed(Peer& p) = 0;
  // Nothing of ours flows into region `region` of `peer` any more (the owner closes it).
  virtual void release(uint64_t peer, uint64_t region) = 0;
  // We are closing `region`: true if peer `p` may still reach it through this route, so that
  // deregistration waits for its release.
  virtual bool must_release(const Region& region, const Peer& p) = 0;
  // Before the worker stops: waits for the route's own work (nothing of it is reported).
  virtual void stop() = 0;
};

}  // namespace p2p::engine
