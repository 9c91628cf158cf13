#include "routes/cuda_ipc/export.h"

#include "common/wire.h"

namespace p2p::ipc {
namespace {
constexpr size_t kLegacyHandleBytes = 64;  // sizeof(cudaIpcMemHandle_t)
}  // namespace

std::string IpcExport::encode() const {
  ByteWriter w;
  w.put(static_cast<uint8_t>(shared.kind));
  w.put_bytes(shared.handle);
  w.put(shared.offset);
  w.put(ptr);
  return std::move(w.str());
}

IpcExport IpcExport::decode(const std::string* bytes, int8_t device_type) {
  IpcExport x;
  if (!bytes) return x;
  ByteReader r(*bytes, "IPC export");
  const uint8_t kind = r.get<uint8_t>();
  x.shared.handle = std::string(r.get_bytes(kLegacyHandleBytes));
  x.shared.offset = r.get<uint64_t>();
  x.ptr = r.get<uint64_t>();
  r.expect_end();
  const bool legacy = kind == cuda::Export::Legacy && x.shared.handle.size() == kLegacyHandleBytes;
  const bool vmm = kind == cuda::Export::Vmm && x.shared.handle.empty();
  if (device_type != 1 || !(legacy || vmm)) r.fail("bad IPC export");
  x.shared.kind = static_cast<cuda::Export::Kind>(kind);
  return x;
}

}  // namespace p2p::ipc
