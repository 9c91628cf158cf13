// What the IPC route writes into a CUDA region's handle (RemoteRegion::route_bytes, under the
// route's id) and reads back at the peer: how the storage is shared (cuda::Export), and its
// address in the owner's process, which serves engines of that same process.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "cuda/ipc_memory.h"

namespace p2p::ipc {

struct IpcExport {
  cuda::Export shared;
  uint64_t ptr = 0;

  std::string encode() const;
  // The export in a handle's bytes; throws a Value error ("bad IPC export") for bytes no owner
  // writes (a forged or damaged handle), kind None for a region with none.
  static IpcExport decode(const std::string* bytes, int8_t device_type);
};

}  // namespace p2p::ipc
