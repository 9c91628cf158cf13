// Registration: how a storage of each memory kind registers with a provider's NICs, decided from
// the provider's profile and what its answer offers (FI_HMEM; FI_MR_DMABUF from libfabric 1.20),
// in one place that the worker asks and CPU tests cover for every profile.
//
//   host memory             registered as it is
//   CUDA memory, no FI_HMEM the staging slots (pinned host memory) stand in for it
//   CUDA memory, dma-buf    each piece's dma-buf (cuMemGetHandleForAddressRange) registered with
//                           FI_MR_DMABUF: no nvidia-peermem, and VMM memory (expandable
//                           segments) as well as cudaMalloc'd
//   CUDA memory, FI_HMEM    the address with FI_HMEM_CUDA (GPUDirect RDMA through nvidia-peermem);
//                           VMM memory the provider refuses goes to the staging slots
//
// With libfabric headers older than 1.20 the flag and struct are the documented 1.20 ones
// (dmabuf.h below): whether they are used is the runtime's answer, never the build's.
#pragma once

#include <rdma/fi_domain.h>

#include <cstdint>
#include <string>

#include "fabric/profile.h"

#ifndef FI_MR_DMABUF  // libfabric < 1.20 headers: fi_mr(3) of 1.20
#define FI_MR_DMABUF (1ULL << 40)
struct fi_mr_dmabuf {
  int fd;
  uint64_t offset;
  size_t len;
  void* base_addr;
};
#endif

namespace p2p::fabric {

enum class MemoryKind : uint8_t { Host, Cuda, CudaVmm };
enum class Registration : uint8_t { Host, Hmem, DmaBuf, Staged };

struct RegistrationChoice {
  Registration how = Registration::Host;
  const char* why = "";  // what a user reads (doctor, the engine's log)
};

// hmem: the answer has FI_HMEM; dmabuf: FI_MR_DMABUF is offered (Limits::dmabuf).
RegistrationChoice choose_registration(const Profile& profile, bool hmem, bool dmabuf, MemoryKind kind);
const char* name(Registration how);

// A dma-buf standing for [base, base + len) of GPU memory (Rail::register_memory).
struct DmaBuf {
  int fd = -1;
  uint64_t offset = 0;  // of base in the dma-buf
  void* base = nullptr;
  size_t len = 0;
};

}  // namespace p2p::fabric
