// What the IPC route needs of CUDA: exporting a storage, mapping a peer's (cudaIpc handles or
// VMM allocations), and copying between mapped memory on the engine's own stream. One IpcMemory per CUDA engine, used by its worker
// thread only. Defined in a CUDA build only (ipc_memory.cpp).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/copier.h"
#include "cuda/vmm.h"

namespace p2p::cuda {

// How a storage of ours is shared with same-host peers.
struct Export {
  enum Kind : uint8_t { None = 0, Legacy = 1, Vmm = 2 } kind = None;
  std::string handle;   // Legacy: the cudaIpcMemHandle_t bytes
  uint64_t offset = 0;  // the storage's first byte in its allocation (Vmm: in its first mapping)
};

class IpcMemory {
 public:
  virtual ~IpcMemory() = default;
  // How [ptr, ptr + nbytes) can be shared: a cudaIpcMemHandle of the allocation holding it
  // (caching-allocator blocks), or VMM memory whose allocations export_vmm() passes as file
  // descriptors (PyTorch's expandable segments); kind None (and `why` set) where neither.
  virtual Export export_storage(void* ptr, uint64_t nbytes, std::string& why) = 0;
  // A VMM export's allocations, as vmm_export() gives them (the caller closes the descriptors).
  virtual std::vector<VmmChunk> export_vmm(uint64_t ptr, uint64_t nbytes, std::string& why) = 0;
  // Maps a peer's allocation into this process; returns its base and sets its size. Throws an
  // Error saying why it cannot (no IPC namespace in common, no P2P between the GPUs, ...).
  virtual void* open(const std::string& handle, uint64_t& size) = 0;
  // The same for a peer's VMM allocations (their descriptors are closed here, mapped or not).
  virtual void* open_vmm(std::vector<VmmChunk>& chunks, uint64_t& size) = 0;
  // Unmaps what open() or open_vmm() mapped.
  virtual void close(void* base) = 0;
  // True when [ptr, ptr + nbytes) is device memory of this process (an engine of ours owns it).
  virtual bool owns(uint64_t ptr, uint64_t nbytes) = 0;
  // Queues every span and page (device memory, or mapped memory of a peer) after the work
  // behind `after` (a cudaEvent_t, or null); returns a ticket. Tickets complete in order. The
  // page ids are read before copy() returns. Copies may wait for flush() to go out: the calls
  // queued between two flushes share one launch and one ticket.
  virtual uint64_t copy(const std::vector<core::CopySpan>& spans, const std::vector<core::CopyPages>& pages,
                        void* after) = 0;
  virtual void flush() = 0;
  virtual bool done(uint64_t ticket) = 0;
  // A cudaEvent_t (from cuda::take_event) recorded after every copy queued so far (flushing
  // them first), or null if recording failed. Whoever takes it recycles it.
  virtual void* mark() = 0;
  // Why the copies of a done ticket failed, empty if they did not: the stream's first
  // asynchronous CUDA error (it sticks, as it does in CUDA, and fails every ticket after it),
  // or its batch's own (a launch or stream wait refused, no pinned memory for the batch's
  // descriptors), which fails that batch only. Asked in ticket order.
  virtual std::string error(uint64_t ticket) = 0;
};

// copy_engine_bytes: spans at least this long go to the copy engines (cudaMemcpyAsync), the
// rest to one gather kernel per call.
std::unique_ptr<IpcMemory> make_ipc_memory(int cuda_device, uint64_t copy_engine_bytes);

}  // namespace p2p::cuda
