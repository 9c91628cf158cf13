// Region: a storage registered with this engine, as the worker knows it.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "fabric/rail.h"

namespace p2p::engine {

// A host region's shared-memory file (a tensor after torch's share_memory_()): its descriptor
// in the owner's process (-1: none), the region's offset in it, and the file's identity, which
// whoever takes the descriptor checks (a descriptor number may be reused once closed). Same-host
// peers may map the file instead of copying through the kernel (routes/host_cma). The tensor's
// allocator owns the descriptor; the engine keeps the tensor while the region lives.
struct HostFile {
  int32_t fd = -1;
  uint64_t offset = 0;
  uint64_t device = 0, inode = 0;  // st_dev, st_ino
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
  bool exported = false;  // for CUDA IPC: same-host peers may have it mapped
  uint64_t piece_bytes = 0;
  HostFile file;
  // [piece * rails + rail] (mr_index); none where a route keeps the region off the NICs
  // (Route::keeps_off_nics: the staged route moves its bytes through its slots).
  std::vector<fabric::MrHandle> mrs;
  bool closing = false;

  bool on_nics() const { return !mrs.empty(); }
};

}  // namespace p2p::engine
