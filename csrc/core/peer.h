// Peer: another engine, as this worker knows it. No world: a peer is whoever we were given an
// address of, or whoever introduced itself. Owned by the worker, keyed by incarnation (one
// process at one set of rails); touched only on the worker thread.
#pragma once

#include <rdma/fabric.h>

#include <cstdint>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "common/error.h"
#include "core/address.h"
#include "core/liveness.h"

namespace p2p::core {

struct Transfer;

struct Peer {
  explicit Peer(double peer_timeout_s) : live(peer_timeout_s) {}

  EngineAddress address;
  std::string address_bytes;
  uint64_t incarnation = 0;
  // Its state and the schedule of HELLOs that establish and check it. A check asks a Ready
  // peer whose silence or failed op needs explaining to introduce itself again: new transfers
  // wait for the answer, as while Connecting; a different incarnation answering means that it
  // restarted.
  Liveness live;
  Status failure;                // why Dead or Left
  std::vector<fi_addr_t> fi;     // [local rail * remote rails + remote rail] (RailPair::address)
  bool confirmed = false;        // it answered from these rails: its address is settled
  std::vector<uint64_t> connect_waiters;
  std::vector<Transfer*> waiting;  // until Ready
  size_t busy = 0;                 // transfers, jobs and messages involving it (begin_work())
  uint64_t disconnect_id = 0;
  uint32_t next_message = 0;
  // Its engine closed (on_bye()), its process exited, or another process took its address:
  // never contact it again.
  bool closed = false;
  bool left_us = false;  // it said goodbye (its disconnect()): only our connect() contacts it again
  // After it failed: the rail threads' Forget markers still out (its connections are cut once
  // all are back, Peers::cut) and when ops the provider still holds for it are given up on
  // (Worker::peer_failed). 0: nothing of it is draining.
  size_t forgets_out = 0;
  double drain_until = 0;
  bool revive_when_drained = false;  // a call came meanwhile: a new contact begins once drained
  int pidfd = -1;                  // same-host peers we map: their process, to see it exit
  bool process_gone = false;       // its process had exited when we came to watch it
  std::unordered_set<uint64_t> closed_regions;  // its regions it told us it deregistered
  std::unordered_set<uint64_t> to_release;      // of those, the ones we still owe a release
  // Its live regions when it introduced itself: ids up to live_regions_upto not listed were gone.
  uint64_t live_regions_upto = 0;
  std::vector<std::pair<uint64_t, uint64_t>> live_regions;  // sorted id ranges, inclusive
  std::unordered_map<uint32_t, std::string> partial;  // user messages being reassembled
  std::unordered_map<uint32_t, uint64_t> unacked;     // our messages to it: id -> transfer

  bool region_gone(uint64_t id) const;
  // Its own reactions to its failure (Peers::fail): failed from the event's start, so that
  // nothing sends to it or waits on it; what it keeps of messages and its process, at the end.
  void mark_failed(const Status& why, PeerState state) {
    live.fail(state);
    failure = why;
  }
  void forget();
  uint16_t remote_rails() const { return static_cast<uint16_t>(address.rails.size()); }
  PeerState state() const { return live.state(); }
  bool failed() const { return live.failed(); }
  bool waits() const { return live.waits(); }  // new transfers wait for its answer
  // New transfers fail at once; unless a new contact begins once it has drained, which they wait for.
  bool refuses() const { return failed() && !revive_when_drained; }
  bool draining() const { return drain_until > 0; }
};

// A peer's failure, as each part that keeps something of the peer hears it (Peers::fail).
struct PeerFailure {
  Peer& peer;
  const Status& why;
  PeerState state;  // Dead, or Left (its goodbye, or our disconnect)
};

}  // namespace p2p::core
