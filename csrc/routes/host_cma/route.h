// Route: the same-host host-memory route. A transfer between host memory of two engines on one
// host (same boot id and pid namespace, both with the route on) skips the fabric: the initiator
// moves the whole call with process_vm_writev / process_vm_readv (copies.h), the kernel copying
// straight between the two processes, one system call per 1024 runs (or 1 GiB), large calls split over a
// few threads.
//
// The owner decides what a peer may reach (core/grants.h): before its first transfer to a
// region, the initiator asks the owner for it and checks every call against the answer, which
// is the owner's registration (a handle that lies gets nothing more than the truth).
//
// The OS decides whether one process may copy another's private memory (ptrace access mode:
// same user, and Yama's ptrace_scope 0, or 1 with the owner's consent, which the owner gives
// to one peer before answering it: ptrace_consent.h). The first answer of each peer for memory
// the kernel copies is tried with a one-byte read: a peer the OS keeps us from is logged once
// and its transfers take the fabric, except to regions we map. A region in a shared-memory
// file needs no leave of the OS: its owner hands us the file's descriptor over a Unix socket
// before the answer (common/descriptors.h) and we map it.
//
// A dead peer: its copies fail at once (ESRCH) and the worker fails the peer; nothing of the
// route waits on another process, so no lock or copy of a dead peer holds anything up.
//
// The route lends its copies (PeerCopies, peer_copies.cpp) to the staged route's host hop:
// the same threads, OS checks and failures, for the staging slots of both ends.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/descriptors.h"
#include "core/config.h"
#include "core/copies.h"
#include "core/grants.h"
#include "core/route.h"
#include "routes/host_cma/shared_file.h"

namespace p2p::cma {

using core::Copies;
using core::Outcome;
using core::Span;

class Route final : public core::Route, public core::PeerCopies {
 public:
  // id: the route's index in the registry (its messages carry it); host_id: host_identity().
  Route(core::RouteHost& host, uint8_t id, const core::Config& config, std::string host_id);
  ~Route() override;

  const char* name() const override { return "cma"; }
  bool advertised() const override { return on_; }
  bool reaches(const core::EngineAddress& a, const core::RemoteRegion* region) override;
  // Keeps a host region's shared-memory file (SharedFile), which granting() passes to peers.
  void learn(core::Region& region, const c10::StorageImpl& storage) override;
  bool take(core::Transfer& t) override;
  bool poll() override;
  bool idle() const override { return !copies_ || !copies_->ended(); }
  void on_message(core::Peer& p, std::string_view body) override;
  void peer_failed(core::Peer& p) override;
  void release(uint64_t peer, uint64_t region) override;
  bool must_release(const core::Region& region, const core::Peer& p) override;
  void stop() override;

  // PeerCopies (peer_copies.cpp).
  bool reaches(const core::Peer& p) const override;
  bool allowed(core::Peer& p, uint64_t addr) override;
  bool consent(const core::Peer& p) override;
  void copy(core::Peer& p, std::vector<Span> spans, bool write, core::CopyOwner& owner) override;

 private:
  // reaches(), for host memory of this engine whatever its device, whether or not the OS
  // lets the kernel copy (a mapped region needs no leave).
  bool peer_reaches(const core::EngineAddress& a, const core::RemoteRegion* region) const;
  // Starts t's copy once every region it touches is answered; false if one is not.
  bool try_start(core::Transfer& t);
  // How a copy with p that ended with `error` ends: fails p first if its process is gone.
  Status outcome(core::Peer& p, int error);
  // Owner side, before answering p for `region`: hands p the region's file, or where it
  // cannot, consents to p's copies; returns the file as the answer carries it (or "").
  std::string granting(core::Peer& p, const core::Region& region);
  // Maps the owner's shared-memory file of a grant, from the descriptor it passed; logs the
  // first outcome with each peer.
  void map(const core::Peer& p, core::Grants::Grant& grant);
  // After resolve(): where every region of the call is mapped, points `spans` into the
  // mappings and returns what keeps them; else null (the kernel copies).
  std::shared_ptr<const void> in_mappings(std::vector<Span>& spans) const;

  core::RouteHost& host_;
  const uint8_t id_;
  const std::string host_id_;
  const bool engine_memory_;  // this engine's own memory is host memory the route may move
  bool on_ = false;
  bool map_ = false;  // maps owners' shared-memory files (cma_map)
  int scope_ = 0;     // Yama's ptrace_scope
  bool listening_ = false;  // for owners' descriptors (from the first take(): our incarnation is set)
  Descriptors descriptors_{"cma"};
  // Owner side.
  std::unordered_set<uint64_t> unconsented_;  // peers we could not consent to (logged)
  std::unordered_set<uint64_t> logged_pushes_;  // peers whose failed descriptor push was logged
  std::unique_ptr<Copies> copies_;
  core::Grants grants_;
  // Initiator side.
  Populator populator_;  // faults the mappings' pages in ahead of their copies
  std::unordered_map<uint64_t, std::string> denied_;  // peers whose memory the OS keeps from our kernel copies: why
  std::unordered_set<uint64_t> tried_;                // peers whose access was tried
  std::unordered_set<uint64_t> logged_maps_;          // peers whose first mapping was logged
  std::unordered_map<uint64_t, core::Transfer*> copying_;  // by ticket
  std::unordered_map<uint64_t, std::pair<core::Peer*, core::CopyOwner*>> lent_;  // by ticket
  std::vector<Outcome> ended_;                               // poll()'s, kept for its buffer
};

}  // namespace p2p::cma
