#include "fabric/registration.h"

namespace p2p::fabric {

RegistrationChoice choose_registration(const Profile& profile, bool hmem, bool dmabuf, MemoryKind kind) {
  if (kind == MemoryKind::Host) return {Registration::Host, "host memory, registered as it is"};
  if (!hmem)
    return {Registration::Staged, "no FI_HMEM: GPU memory goes through pinned host staging slots"};
  if (dmabuf && profile.dmabuf)
    return {Registration::DmaBuf, "dma-buf (FI_MR_DMABUF): GPU memory, VMM or not, without nvidia-peermem"};
  if (kind == MemoryKind::CudaVmm)
    return {Registration::Hmem, "FI_HMEM_CUDA (needs nvidia-peermem); VMM memory the provider refuses goes "
                                "through pinned host staging slots"};
  return {Registration::Hmem, "FI_HMEM_CUDA: GPUDirect RDMA through nvidia-peermem"};
}

const char* name(Registration how) {
  switch (how) {
    case Registration::Host: return "host";
    case Registration::Hmem: return "hmem";
    case Registration::DmaBuf: return "dmabuf";
    case Registration::Staged: return "staged";
  }
  return "?";
}

}  // namespace p2p::fabric
