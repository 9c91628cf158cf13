// Route: the same-host CUDA IPC route. A transfer between CUDA memory of two engines on one
// host (boot id and pid namespace alike, both CUDA engines with IPC on) skips the fabric: the
// initiator maps the owner's exported storage once (cached per region, mappings.h) and moves
// the whole call with one queued copy (a gather kernel for small runs, the copy engines for
// large ones) on its own stream, after the caller's stream event. A stream that follows the
// transfer waits on an event recorded after the copy, on the GPU only. The transfer completes
// once the copy's ticket is done.
//
// The owner exports each CUDA storage as it is registered (describe()): the handle carries the
// export (export.h). A caching-allocator block travels as a cudaIpcMemHandle, which the
// initiator opens. VMM memory (PyTorch's expandable segments, cuda/vmm.h) has no such handle:
// before the first transfer to such a region, the initiator asks the owner for it (a route
// message); the owner, if the region is still live, exports each physical allocation under it
// as a file descriptor, passes them over a Unix socket (common/descriptors.h: no ptrace access
// either way) and answers with their sizes; the initiator maps them back to back into one range
// and resumes the transfers that waited. A region closed is never asked for again (the worker
// refuses transfers to it), and its mappings go with its release, as for cudaIpc memory.
//
// A peer whose storage cannot be mapped (no P2P between the GPUs, no IPC namespace in common)
// is logged once and its transfers take the fabric; so do the transfers to a VMM region whose
// export fails (logged once per region, with the reason).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/descriptors.h"
#include "core/config.h"
#include "core/route.h"
#include "routes/cuda_ipc/mappings.h"

namespace p2p::ipc {

class Route final : public core::Route {
 public:
  // id: the route's index in the registry; host_id: host_identity().
  Route(core::RouteHost& host, uint8_t id, const core::Config& config, std::string host_id);
  ~Route() override;

  const char* name() const override { return "ipc"; }
  bool advertised() const override { return mappings_ != nullptr; }
  bool reaches(const core::EngineAddress& a, const core::RemoteRegion* region) override;
  void describe(core::Region& region, core::RemoteRegion& handle) override;
  bool take(core::Transfer& t) override;
  core::StreamOrder stream_order(const core::Transfer& t) override;
  bool poll() override;
  bool idle() const override { return copies_.empty(); }
  void on_message(core::Peer& p, std::string_view body) override;
  void peer_failed(core::Peer& p) override;
  void release(uint64_t peer, uint64_t region) override;
  bool must_release(const core::Region& region, const core::Peer& p) override;
  void stop() override;

 private:
  using RegionKey = std::pair<uint64_t, uint64_t>;  // (peer, region id)

  bool peer_reaches(const core::EngineAddress& a) const;
  // The export in `region`'s handle (kind None: none); throws the Value error of a forged one.
  IpcExport export_of(const core::RemoteRegion& region) const;
  // Whether `region` of peer `a` is mapped from the owner's descriptors (VMM memory of another
  // process), so that a transfer to it waits for the owner's answer first.
  bool asks(const core::EngineAddress& a, const IpcExport& x) const;
  // Maps `region` of peer `a`; false (said once) where the peer cannot be mapped at all.
  // Throws the Value error of a handle that lies about its memory.
  bool map(const core::EngineAddress& a, const core::RemoteRegion& region, const IpcExport& x);
  // Queues t's copy (every region mapped); or ends it where a region cannot be had.
  void start(core::Transfer& t);
  // Owner side: a peer asks for VMM region `region`: passes its allocations, and answers.
  void answer(core::Peer& p, uint64_t region);
  // Initiator side: the owner's answer for `region` (sizes of its allocations, or why not).
  void answered(core::Peer& p, uint64_t region, Status refused, std::vector<uint64_t> sizes);

  core::RouteHost& host_;
  const uint8_t id_;
  const std::string host_id_;
  std::unique_ptr<Mappings> mappings_;  // null where the route is off
  std::vector<std::pair<uint64_t, core::Transfer*>> copies_;  // (ticket, transfer), in order
  std::unordered_map<uint64_t, std::string> unreachable_;        // peers whose mapping failed: why
  // VMM memory of other processes (initiator side).
  Descriptors descriptors_{"ipc"};
  bool listening_ = false;
  std::set<RegionKey> asked_;                // no answer yet
  std::map<RegionKey, Status> refused_;      // answered with no mapping: why
  std::unordered_map<uint64_t, std::vector<core::Transfer*>> waiting_;  // by peer, for answers
};

}  // namespace p2p::ipc
