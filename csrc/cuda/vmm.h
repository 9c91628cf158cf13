// CUDA VMM memory (cuMemCreate + cuMemMap, as PyTorch's expandable segments allocate): finding
// the physical allocations under a storage, exporting them as file descriptors, and mapping a
// peer's into one range of this process with the same layout. Driver calls go through the
// runtime (driver_function): no libcuda link. Defined in a CUDA build only (vmm.cpp).
//
// An expandable segment grows by mapping more physical chunks after the last one in a range it
// reserved once, so one storage may span several allocations: cuMemGetAddressRange names one
// mapping at a time, and the walk goes chunk by chunk. Only allocations created with
// CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR among their requested handle types can be exported.
//
// Thread model: none of its own; the callers' (the IPC route's worker thread).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace p2p::cuda {

// One mapping of a VMM storage: its place in the owner's range and, once exported, the
// descriptor of its physical allocation (owned by whoever holds the chunk; -1: none).
struct VmmChunk {
  uint64_t base = 0;
  uint64_t size = 0;
  int fd = -1;
};

// The mappings under [ptr, ptr + nbytes), in address order and back to back; empty, with `why`,
// where the range is not all VMM memory, has a hole, or an allocation was not created
// exportable (then it says so).
std::vector<VmmChunk> vmm_layout(uint64_t ptr, uint64_t nbytes, std::string& why);
// vmm_layout() with each chunk's allocation exported as a POSIX file descriptor (the caller
// closes them); empty, with `why`, where any export fails.
std::vector<VmmChunk> vmm_export(uint64_t ptr, uint64_t nbytes, std::string& why);
// Maps the allocations of `chunks` (sizes and descriptors; the descriptors are closed here,
// mapped or not) back to back into a fresh range of this process, readable and writable by
// `device`; returns its base. Throws an Error naming the driver call that failed.
uint64_t vmm_import(int device, std::vector<VmmChunk>& chunks);
// Unmaps and frees a range vmm_import() returned (`size`: the chunks' total).
void vmm_unmap(uint64_t base, uint64_t size);

// A dma-buf of GPU memory (VMM or cudaMalloc'd) for NIC registration (fabric/registration.h):
// [ptr, ptr + len) widened to whole host pages, whose start and length are set; the descriptor
// is the caller's. -1, with `why`, where the driver refuses (cuMemGetHandleForAddressRange).
int dmabuf_fd(uint64_t ptr, uint64_t len, uint64_t& start, uint64_t& size, std::string& why);

}  // namespace p2p::cuda
