// Provider choice: one set of hints for every provider, the differences (mr_mode bits,
// key size, FI_HMEM, delivery-complete) read back from what libfabric grants.
#pragma once

#include <rdma/fabric.h>

#include <memory>
#include <string>
#include <vector>

namespace p2p::fabric {

struct InfoDeleter {
  void operator()(fi_info* info) const { fi_freeinfo(info); }
};
using InfoPtr = std::unique_ptr<fi_info, InfoDeleter>;

// A NIC as libfabric lists it; torch_p2p/topology.py picks rails among these.
struct Nic {
  std::string provider;
  std::string fabric;
  std::string domain;
  std::string pci;          // "0000:10:1b.0", empty when not a PCI device
  uint64_t speed_bps = 0;   // 0 when unknown
};

// The settings (core/config.h) that shape the query and the rails opened from its answer.
struct QueryOptions {
  uint32_t api_version = 0;      // 0: the runtime's own, capped at one we know
  bool manual_progress = false;  // never ask for provider progress threads (measurements)
  bool shm_fast = false;         // shm may take its unchecked "fast RMA" path (see hints())
  bool hmem_device_only = true;  // shm moves CUDA memory by CUDA IPC (see Rail)
  bool efa_shaped = false;       // EFA's limits on any provider (EfaShape), for tests
};

// The EFA-shaped test profile (TORCH_P2P_PROFILE=efa): EFA's published limits, which an engine
// keeps on whatever provider it runs on, so that the paths EFA takes run where EFA is absent.
// The advertised limits shape what the engine posts; Rail enforces them as EFA would (an op
// that breaks one fails), so a path that ignores a limit fails its tests. docs/providers.md
// lists what the profile covers and what it cannot.
struct EfaShape {
  static constexpr size_t kRmaIov = 1;           // efa: rma_iov_limit 1
  static constexpr size_t kKeyBytes = 4;         // efa: mr_key_size 4
  static constexpr size_t kMaxRma = 256 << 10;   // efa-direct's max_rdma_size (about 1 GiB), scaled
                                                 // down so that tests of a few MiB split at it
};

// What one provider offers for RDM endpoints with RMA.
struct Offer {
  InfoPtr list;
  std::string provider;            // the real stack, e.g. "tcp;ofi_rxm"
  bool hmem = false;               // FI_HMEM granted: CUDA memory can be registered
  bool delivery_complete = false;  // completions mean the data is in remote memory
  bool auto_progress = false;      // the provider moves data on threads of its own
  uint32_t api_version = 0;
  QueryOptions options;            // what it was asked with

  std::vector<Nic> nics() const;   // one per distinct domain name, in libfabric's order
  size_t max_rma() const;          // the largest RMA one op may move
  const fi_info* domain(const std::string& name) const;  // nullptr when absent
};

// What a provider's answer grants, as the engine uses it (python -m torch_p2p.doctor reports it).
struct Limits {
  std::vector<std::string> mr_mode;  // the FI_MR_* bits granted, by name
  size_t iov_limit = 0;              // tx_attr
  size_t rma_iov_limit = 0;          // tx_attr
  size_t inject_size = 0;            // tx_attr
  size_t max_msg_size = 0;           // ep_attr: also the largest RMA the provider takes
  size_t cq_data_size = 0;           // domain_attr
  size_t mr_key_size = 0;            // domain_attr
  bool dmabuf = false;               // FI_MR_DMABUF offered (libfabric >= 1.20)
};
Limits limits(const fi_info& info);

// Resolves "efa", "verbs", "tcp", "shm", a full stack such as "tcp;ofi_rxm", or "" (the best
// of efa, verbs, tcp) and queries it. Throws a ValueError-kind Error naming what this machine
// offers when nothing matches.
Offer query(const std::string& provider, bool want_hmem, const QueryOptions& options);

}  // namespace p2p::fabric
