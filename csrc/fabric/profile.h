// Profile: what the engine does differently per libfabric provider, in one table. Whatever is
// provider-specific and not read from fi_info at run time is a field here, with the reason
// beside it; the code asks the profile, never a provider's name. Python reads the same table
// (_C.provider_profile: engine.py's rail count, doctor's checks).
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

namespace p2p::fabric {

struct Profile {
  const char* name;       // matches a provider by its first name ("tcp" matches "tcp;ofi_rxm")
  int default_rank;       // Engine(provider=None) tries ranks 1, 2, ... in order; 0: only by name
  bool remote;            // reaches other hosts (shm: this host only)
  bool rdma;              // NIC RDMA: GPU memory may go to the NIC directly (FI_HMEM, dma-buf)
  // Registers GPU memory from a dma-buf where libfabric offers FI_MR_DMABUF (>= 1.20): EFA
  // and verbs (ibv_reg_dmabuf_mr). See registration.h.
  bool dmabuf;
  // tcp moves every byte through the kernel on the thread that drives its progress: asked for
  // FI_PROGRESS_AUTO, rxm runs a progress thread per endpoint (one per rail, on both ends).
  // Hinting AUTO drops EFA's `efa` fabric, and shm has none.
  bool auto_progress;
  bool rails_from_cores;  // default rails from the process's cores (topology.default_tcp_rails)
  // The largest chunk where the user sets none (0: the engine's default). shm is one rail and
  // each of its RMAs of GPU memory is one CUDA IPC copy: larger chunks are faster.
  uint64_t max_chunk;
  // shm's "fast RMA" path for host memory copies into the target with CMA without asking it,
  // so no key, access right or bound is checked: asking FI_ORDER_RAW keeps it off for the
  // domain, unless TORCH_P2P_SHM_FAST=1. On that path an op takes one remote segment.
  bool unchecked_fast_rma;
  // FI_HMEM_DEVICE_ONLY registrations make the provider move GPU memory by CUDA IPC, whose RMA
  // completes before the data lands: GPU writes need the engine's fence (routes/fabric/route.h).
  bool cuda_ipc_rma;
  // The provider names an endpoint's file after the process id, and a killed process leaves
  // it behind for the next process with that pid: the engine names its endpoints itself.
  bool own_endpoint_names;
  // Ops to a dead peer may never complete and a closed region's bytes may still be read by a
  // peer's queued command: deregistration waits for every peer's release.
  bool peers_must_release;
  // The target's progress serves an RMA (shm: each read takes several steps of both sides), and
  // nothing wakes an idle target when one arrives: it would nap 50-100 us a step. A requester
  // with RMA in flight sends it a KeepPolling message now and then (routes/fabric/route.h).
  bool target_progress;
  // An endpoint reaches another endpoint of its own process through that one's mapping of its
  // shared memory, which closing it unmaps: the engine parks a closed endpoint while another of
  // the process is open (fabric/rail.cpp, OwnEndpoints).
  bool shares_own_endpoints;
  const char* known_problem;  // what doctor warns of when it is chosen, or null
};

// The profile of `provider` (a name or a stack such as "tcp;ofi_rxm"); an unknown provider
// gets one with no quirks.
const Profile& profile(std::string_view provider);
// Every provider the table knows.
const std::vector<Profile>& profiles();
// The providers Engine(provider=None) tries, in order.
std::vector<const char*> default_providers();

}  // namespace p2p::fabric
