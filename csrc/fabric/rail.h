// Rail: one NIC (libfabric domain) with its own fabric, domain, completion queue, address
// vector, event queue and RDM endpoint: a NIC is a small struct.
//
// Thread model: a Rail is created, used and destroyed by one worker thread only. The domain
// is opened FI_THREAD_DOMAIN, so nothing here locks and no other thread may touch it, memory
// registration included.
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_rma.h>
#include <sys/uio.h>

#include <rdma/fi_errno.h>

#include <string>
#include <unordered_map>

#include "common/log.h"
#include "fabric/info.h"
#include "fabric/registration.h"

namespace p2p::fabric {

// A registration of one buffer in one domain.
struct MrHandle {
  fid_mr* mr = nullptr;
  void* desc = nullptr;   // local descriptor for FI_MR_LOCAL / FI_MR_HMEM providers
  uint64_t key = 0;       // what a peer names in its RMA
  uint64_t base = 0;      // the remote address of the buffer's first byte: its virtual address
                          // under FI_MR_VIRT_ADDR, else 0 (offsets)
};

class Rail {
 public:
  // port != 0 binds the endpoint to that port (providers with IP addresses only). `options`:
  // what the provider was queried with (Offer::options).
  Rail(const fi_info* info, size_t cq_size, uint16_t port, const QueryOptions& options);
  ~Rail();
  Rail(const Rail&) = delete;
  Rail& operator=(const Rail&) = delete;

  const std::string& address() const { return address_; }
  const fi_info* info() const { return info_.get(); }
  const char* domain_name() const { return info_->domain_attr->name; }
  size_t tx_depth() const { return info_->tx_attr->size; }

  // Address vector entries are shared by every peer that names the same raw address (a
  // restarted peer reuses its predecessor's) and kept for the rail's life.
  fi_addr_t insert(const std::string& raw_address);
  // Removes the entry and inserts it again: the provider tears down the connections under it
  // and flushes what was posted on them (FI_AV_REMOVE_CLEANUP, info.cpp); the next op to the
  // address connects anew. Returns the entry's new fi_addr (the same one, on most providers).
  fi_addr_t cut(fi_addr_t addr);

  // access: FI_READ/FI_WRITE/FI_SEND/FI_RECV/FI_REMOTE_READ/FI_REMOTE_WRITE bits.
  // cuda_device < 0 registers host memory.
  // dmabuf: GPU memory registered from a dma-buf (FI_MR_DMABUF, registration.h) that covers
  // [ptr, ptr + len); null: by address.
  MrHandle register_memory(void* ptr, size_t len, uint64_t access, int cuda_device, const DmaBuf* dmabuf = nullptr);
  void deregister(MrHandle& handle);

  // Scatter-gather RMA: n local segments to (or from) n remote segments of the same lengths,
  // n <= max_iov(). device: the local memory is GPU memory (completion semantics on shm).
  ssize_t write(const iovec* iov, void** desc, size_t n, fi_addr_t dest, const fi_rma_iov* rma,
                void* context, uint64_t flags, bool device);
  ssize_t read(const iovec* iov, void** desc, size_t n, fi_addr_t dest, const fi_rma_iov* rma,
               void* context, uint64_t flags);
  size_t max_iov() const { return max_iov_; }
  // True where deregistering must wait until peers have stopped using the region: on shm
  // (libfabric 1.17), whose fast RMA path checks nothing at the target, and whose checked
  // path, refusing an RMA, never completes it at the initiator (its channel to us wedges).
  bool peers_must_release() const { return peers_must_release_; }
  // True where an RMA from or to CUDA memory may complete before the target's CUDA copy has
  // landed: shm moving GPU memory by CUDA IPC.
  bool cuda_ipc() const { return cuda_ipc_; }
  // Profile::target_progress: the target serves our RMA only while it polls.
  bool target_progress() const { return target_progress_; }
  ssize_t send(void* buf, size_t len, void* desc, fi_addr_t dest, void* context);
  ssize_t recv(void* buf, size_t len, void* desc, void* context);

  // Reads up to n completions: the count, 0, or -FI_EAVAIL when an error entry is next
  // (read it with read_error). Other negative values are fatal for the rail.
  ssize_t poll(fi_cq_data_entry* entries, size_t n);
  // Reads the next error entry; the message names the libfabric and provider error.
  bool read_error(fi_cq_err_entry& entry, std::string& message);
  // The completion-queue loop of the worker and of the rail threads: reads completions in
  // batches, up to `rounds` batches (fewer once one comes back short). on_done(op_context, len)
  // for each completion of an op of ours (peers' RMA into our memory, remote CQ data, names
  // none); on_error(entry, message) for each error entry. Returns whether anything was read.
  template <typename OnDone, typename OnError>
  bool drain(int rounds, OnDone&& on_done, OnError&& on_error);

  int wait_fd() const { return wait_fd_; }
  // True when nothing is pending and sleeping on wait_fd() cannot miss an event.
  bool trywait();


 private:
  InfoPtr info_;
  fid_fabric* fabric_ = nullptr;
  fid_domain* domain_ = nullptr;
  fid_cq* cq_ = nullptr;
  fid_av* av_ = nullptr;
  fid_eq* eq_ = nullptr;
  fid_ep* ep_ = nullptr;
  int wait_fd_ = -1;
  uint64_t completion_flags_ = 0;       // for writes from GPU memory
  uint64_t host_completion_flags_ = 0;  // for writes from host memory
  size_t max_iov_ = 1;
  bool efa_shaped_ = false;  // QueryOptions::efa_shaped: EFA's limits enforced (EfaShape)
  ssize_t efa_refuses(const iovec* iov, void** desc, size_t n, const fi_rma_iov* rma, uint64_t flags) const;
  bool peers_must_release_ = false;
  bool target_progress_ = false;
  bool cuda_ipc_ = false;
  bool shares_own_endpoints_ = false;  // Profile::shares_own_endpoints: see OwnEndpoints
  std::string address_;
  struct AvEntry {
    fi_addr_t addr;
    int users;
  };
  std::unordered_map<std::string, AvEntry> av_entries_;
};

template <typename OnDone, typename OnError>
bool Rail::drain(int rounds, OnDone&& on_done, OnError&& on_error) {
  constexpr size_t kBatch = 64;
  fi_cq_data_entry entries[kBatch];
  bool any = false;
  for (int round = 0; round < rounds; ++round) {
    const ssize_t n = poll(entries, kBatch);
    if (n == -FI_EAVAIL) {
      fi_cq_err_entry err;
      std::string message;
      if (read_error(err, message)) on_error(err, message);
      any = true;
      continue;
    }
    if (n < 0) {
      P2P_LOG(Error, "fi_cq_read on ", domain_name(), ": ", fi_error_name(-n));
      break;
    }
    for (ssize_t i = 0; i < n; ++i)
      if (!(entries[i].flags & (FI_REMOTE_WRITE | FI_REMOTE_READ)) && entries[i].op_context)
        on_done(entries[i].op_context, entries[i].len);
    any |= n > 0;
    if (n < static_cast<ssize_t>(kBatch)) break;
  }
  return any;
}

}  // namespace p2p::fabric
