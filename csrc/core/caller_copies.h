// CallerCopies: owners' regions that a route has mapped into this process (the cma route maps
// a peer's shared-memory file), which a small call copies with memcpy on the thread that
// makes it. The call then skips the hand-overs that cost more than its bytes on a busy host:
// to the worker, to a copy thread, back to the worker and through the dispatcher to its future
// (docs/performance_calls.md, "Calls copied by the caller").
//
// The worker adds a region once its owner's answer is mapped (Grants), and removes it before
// the region's release goes back to its owner and when the peer fails or leaves: a removal
// waits for the copies that found the region, so no call copies a region after its owner took
// it back. A call is copied here only if it is no larger than cma_inline_bytes, carries no
// notification, every remote region of it is here and passes the worker's checks
// (Grants::check), and the owner's process is still there once the bytes are copied (a
// mapping outlives its process). Any other call goes to the worker, which moves it or reports
// what is wrong with it, so the caller never sees an error from here.
//
// move() runs on any thread (one copy at a time per engine); the rest on the worker.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

#include "core/grants.h"
#include "core/transfer.h"

namespace p2p::core {

class CallerCopies {
 public:
  explicit CallerCopies(uint64_t max_bytes) : max_bytes_(max_bytes) {}
  ~CallerCopies() { clear(); }
  CallerCopies(const CallerCopies&) = delete;
  CallerCopies& operator=(const CallerCopies&) = delete;

  bool on() const { return max_bytes_ > 0; }
  // The answer `grant` of peer p, mapped: calls may copy it from now on (if its process can be
  // watched).
  void add(const Peer& p, const Grants::Grant& grant);
  // The owner closes `region` of `peer` / the peer failed or left / the route stops.
  void forget(uint64_t peer, uint64_t region);
  void forget_peer(uint64_t peer);
  void clear();

  // Moves t's bytes now, on this thread; false if it does not (the worker moves it then).
  bool move(const TransferCall& t);

 private:
  struct Owner {
    uint64_t incarnation = 0;
    int pidfd = -1;  // its process, watched: a copy with a process that exited did not happen
    std::map<std::pair<uint64_t, uint64_t>, Grants::Grant> regions;  // by (region, key)
  };
  // Removes the owners (and closes their pidfds) for which gone(owner) is true.
  template <class Gone>
  void remove(Gone&& gone);

  const uint64_t max_bytes_;
  std::mutex mu_;  // held through a copy (a reader-writer lock would let callers starve a removal)
  std::unordered_map<std::string, Owner> owners_;  // by engine address (its bytes)
};

}  // namespace p2p::core
