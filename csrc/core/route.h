// Route: a way for a transfer's bytes to move, kept in its own folder under csrc/routes/ with
// its own state. The worker offers each transfer to its routes in turn (routes/registry.h; the
// fabric route, last, takes whatever the others decline); a route that takes it owns its bytes
// until it calls RouteHost::done().
//
// A route reaches back into the worker only through RouteHost: its peers' control channel,
// transfer start and completion, the rails, the copier, region lookup, peer and process
// watching and the worker's wake-up. Every method runs on the worker thread, except
// RouteHost::wake(), which any thread may call.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/error.h"
#include "common/wire.h"
#include "core/address.h"
#include "core/config.h"
#include "core/copier.h"
#include "core/copies.h"
#include "core/messages.h"
#include "core/ops.h"
#include "core/peer.h"
#include "core/rails.h"
#include "core/region.h"
#include "core/striper.h"
#include "core/transfer.h"
#include "fabric/rail.h"

namespace c10 {
struct StorageImpl;
}  // namespace c10

namespace p2p::core {

class CallerCopies;

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
  virtual uint64_t incarnation() const = 0;  // ours
  // t is route `route`'s from now on (its work counted in t.pending): marks it so and answers
  // the streams waiting on its order (Route::stream_order). Before anything may finish t.
  virtual void started(Transfer& t, uint8_t route) = 0;
  // One unit of work the route counted in t.pending is over, with its final status (a
  // failure here is the transfer's answer: no check of the peer follows); t may be gone after.
  virtual void done(Transfer& t, const Status& status) = 0;
  // As done(), for a unit that an op's completion ended: a failure that may be the peer's
  // (Peer, Remote) is told once a check of the peer says which.
  virtual void transfer_op_done(Transfer& t, const Status& status) = 0;
  // The route cannot move t after all: the routes after it are offered t (t.pending as it was
  // given), as if it had declined.
  virtual void pass_on(Transfer& t) = 0;
  // Peer p confirmed transfer `transfer` (Route::confirm): it may end.
  virtual void acknowledged(Peer& p, uint64_t transfer) = 0;
  // Sends t's payload to its peer as a user message on the control channel (each fragment
  // counted in t.pending); the peer's acknowledgement ends t.
  virtual void send_user_message(Transfer& t) = 0;
  virtual void fail_peer(Peer& p, Status why) = 0;
  // The live (not closing) region of ours with this id, or null.
  virtual std::shared_ptr<Region> region(uint64_t id) const = 0;
  // Fails p's transfers as soon as its process exits (same host only).
  virtual void watch_process(Peer& p) = 0;
  // Ends the worker's sleep, if it sleeps: from any thread.
  virtual void wake() = 0;
  // p has work of ours in flight that its disconnect waits for, until end_work().
  virtual void begin_work(Peer& p) = 0;
  virtual void end_work(Peer& p) = 0;
  virtual const Config& config() const = 0;
  // The mapped regions that small calls copy on the caller's thread (core/caller_copies.h).
  virtual CallerCopies& caller_copies() = 0;
  // Whether the NICs register this engine's GPU memory (FI_HMEM, and a trial registration
  // worked). Set once the rails are open.
  virtual bool hmem() const = 0;
  virtual Copier& copier() = 0;

  // The fabric, for routes that move bytes with RMA ops of their own (Rails::generate).
  virtual Rails& rails() = 0;
};

// Where a PeerCopies copy's end is told: from the lending route's poll(), on the worker thread.
class CopyOwner {
 public:
  virtual ~CopyOwner() = default;
  // ok, or the failure as the lending route reports its own (a dead peer is failed first).
  virtual void copied(const Status& status) = 0;
};

// Copies between this process's memory and a same-host peer's without the fabric, lent by the
// route that has the OS's leave (the cma route) to another route's host hop (the staged
// route's; routes/registry.cpp hands it over). Worker thread only.
class PeerCopies {
 public:
  virtual ~PeerCopies() = default;
  // Whether p's process may be copied with: on this host, the route on at both ends, and the
  // OS not known to refuse.
  virtual bool reaches(const Peer& p) const = 0;
  // Whether the OS lets us at p's memory: tried once per peer with a one-byte read at `addr`,
  // an address p gave us to reach; false (and logged once) if it refuses.
  virtual bool allowed(Peer& p, uint64_t addr) = 0;
  // Lets p's process copy this process's memory where the OS wants our consent first; false
  // (logged once) where it cannot have it: its copies would be refused.
  virtual bool consent(const Peer& p) = 0;
  // Starts copying spans between our memory and p's (write: ours into p's); owner.copied()
  // follows, never before copy() returns.
  virtual void copy(Peer& p, std::vector<Span> spans, bool write, CopyOwner& owner) = 0;
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
  // Whether this engine's memory on `cuda_device` (-1: host) stays off the NICs because this
  // route moves its bytes itself (the staged route: memory the NICs cannot reach, or
  // data_path="staged"): such a region is registered with no NIC (Region::on_nics).
  virtual bool keeps_off_nics(int cuda_device) const { return false; }
  // A region of ours is being registered from `storage` (the tensor's, alive for the call):
  // the route keeps what it needs of it with the region (Region::keep).
  virtual void learn(Region& region, const c10::StorageImpl& storage) {}
  // A region of ours was registered: adds to its handle what peers need to reach it here.
  virtual void describe(Region& region, RemoteRegion& handle) {}
  // Takes t (its peer is ready, its handles checked), counts its work in t.pending and calls
  // RouteHost::started; false leaves it to the next route.
  virtual bool take(Transfer& t) = 0;
  // t, a transfer of this route whose counted work ended well, is over only once its peer
  // confirms it: confirm(t) asks, and RouteHost::acknowledged() answers.
  virtual bool confirms(const Transfer& t) const { return false; }
  virtual void confirm(Transfer& t) {}
  // t, a transfer of this route, has work under way: a unit of it began or ended, more is due.
  virtual void waiting(Transfer& t) {}
  // What a stream that follows t, a transfer of this route, waits on.
  virtual StreamOrder stream_order(const Transfer& t) { return {StreamOrder::Future}; }
  // Makes progress; true if anything happened.
  virtual bool poll() = 0;
  // True when nothing needs polling: the worker may sleep (wake() ends the sleep).
  virtual bool idle() const = 0;
  // A message from the same route of peer `p`.
  virtual void on_message(Peer& p, std::string_view body) = 0;
  // The worker's timers ran (about every 5 ms: Worker::run's next_tick_).
  virtual void tick() {}
  // Peer `p` failed: its transfers were failed; the route lets go of its state for them.
  virtual void peer_failed(Peer& p) = 0;
  // Nothing of ours flows into region `region` of `peer` any more (the owner closes it).
  virtual void release(uint64_t peer, uint64_t region) = 0;
  // We are closing `region`: true if peer `p` may still reach it through this route, so that
  // deregistration waits for its release.
  virtual bool must_release(const Region& region, const Peer& p) = 0;
  // Before the worker closes its rails: waits for the route's own work (nothing of it is
  // reported) and lets go of its registrations. The route is destroyed after the rails.
  virtual void stop() = 0;
};

}  // namespace p2p::core
