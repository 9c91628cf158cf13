#include "fabric/rail.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <unordered_set>
#include <vector>

#include "common/error.h"
#include "common/log.h"
#include "fabric/profile.h"

namespace p2p::fabric {
namespace {

template <typename Fid>
void close_fid(Fid*& fid) {
  if (!fid) return;
  const int rc = fi_close(&fid->fid);
  if (rc) P2P_LOG(Warn, "fi_close failed: ", fi_error_name(-rc));
  fid = nullptr;
}

// Keys that a peer cannot guess: a peer that learns one handle cannot reach other regions.
uint64_t random_key(size_t key_size) {
  uint64_t key = 0;
  while (getrandom(&key, sizeof key, 0) != static_cast<ssize_t>(sizeof key)) {
  }
  if (key_size > 0 && key_size < 8) key &= (uint64_t{1} << (8 * key_size)) - 1;
  return key;
}

// Profile::cuda_ipc_rma: FI_HMEM_DEVICE_ONLY on CUDA registrations (what fabtests passes) makes
// shm move GPU memory by CUDA IPC, much faster than through its host bounce buffers.
// QueryOptions::hmem_device_only (TORCH_P2P_HMEM_DEVICE_ONLY=0) turns it off.
bool wants_cuda_ipc(const std::string& prov, const QueryOptions& options) {
  return profile(prov).cuda_ipc_rma && options.hmem_device_only;
}

// Profile::own_endpoint_names: shm names an endpoint's shared-memory file after the process id
// ("<pid>:<uid>:<n>" in /dev/shm), and a process killed with SIGKILL leaves its file behind: a
// later process that gets the same pid cannot open its endpoint (fi_enable: FI_EBUSY). Our own
// name carries 64 random bits.
void name_shm_endpoint(fi_info* info) {
  if (!profile(info->fabric_attr->prov_name).own_endpoint_names || info->addr_format != FI_ADDR_STR) return;
  const std::string name = cat("fi_shm://p2p-", getpid(), "-", hex(random_key(8)));
  free(info->src_addr);
  info->src_addr = strdup(name.c_str());
  info->src_addrlen = name.size() + 1;
}

// The provider's info for one rail: our own shm name, the requested port for IP providers.
InfoPtr for_rail(const fi_info* info, uint16_t port) {
  InfoPtr copy(fi_dupinfo(info));
  P2P_CHECK(copy, ErrorKind::Generic, "fi_dupinfo failed");
  name_shm_endpoint(copy.get());
  if (!port) return copy;
  auto* sa = static_cast<sockaddr*>(copy->src_addr);
  P2P_CHECK(sa && (sa->sa_family == AF_INET || sa->sa_family == AF_INET6), ErrorKind::Value,
            "a port was requested but provider ", info->fabric_attr->prov_name,
            " has no IP source address on domain ", info->domain_attr->name);
  if (sa->sa_family == AF_INET)
    reinterpret_cast<sockaddr_in*>(sa)->sin_port = htons(port);
  else
    reinterpret_cast<sockaddr_in6*>(sa)->sin6_port = htons(port);
  return copy;
}

// Profile::shares_own_endpoints (shm, libfabric 1.17): an endpoint reaches another endpoint of
// its own process through that one's own mapping of its shared memory, not a mapping of its
// own, and closing an endpoint unmaps it; the provider also keeps a closed endpoint's name
// listed, the stale pointer with it. So an endpoint closed while another of the process is
// open leaves that one writing into unmapped memory (answering what the closed one sent,
// completing its own sends to it: a SIGSEGV when two engines of one process closed at once),
// or into whatever is mapped there next. Here a closing endpoint is parked: left open and
// silent (nothing polls it) until no endpoint of the process is open, then closed with the
// others. An address of one that has closed, parked or not, is refused: inserting it would
// follow the stale pointer once it is unmapped. Parked endpoints keep their shared memory
// (about 4 MiB each) until then.
class OwnEndpoints {
 public:
  using Close = std::function<void()>;

  void opened() {
    std::lock_guard<std::mutex> lock(mu_);
    ++open_;
  }
  // `close` closes the endpoint's objects, now or once no endpoint of the process is open.
  void closing(const std::string& address, Close close) {
    std::vector<Close> now;
    {
      std::lock_guard<std::mutex> lock(mu_);
      closed_.insert(address);
      parked_.push_back(std::move(close));
      if (--open_ > 0) return;
      now.swap(parked_);
    }
    for (Close& c : now) c();  // no endpoint is open that could reach them
  }
  bool closed(const std::string& address) {
    std::lock_guard<std::mutex> lock(mu_);
    return closed_.count(address) > 0;
  }

 private:
  std::mutex mu_;
  int open_ = 0;
  std::vector<Close> parked_;
  std::unordered_set<std::string> closed_;  // addresses carry 64 random bits: never reused
};

OwnEndpoints& own_endpoints() {
  static auto* endpoints = new OwnEndpoints;  // never destroyed: an engine may close at exit
  return *endpoints;
}

}  // namespace

Rail::Rail(const fi_info* info, size_t cq_size, uint16_t port, const QueryOptions& options)
    : info_(for_rail(info, port)) {
  const char* dom = info_->domain_attr->name;
  FI_CHECK(fi_fabric(info_->fabric_attr, &fabric_, nullptr), "fi_fabric(", dom, ")");
  FI_CHECK(fi_domain(fabric_, info_.get(), &domain_, nullptr), "fi_domain(", dom, ")");

  // A wait object lets an idle worker sleep instead of spinning; not every provider has one
  // (shm does not), and then the worker backs off with short sleeps.
  fi_cq_attr cq_attr{};
  cq_attr.format = FI_CQ_FORMAT_DATA;
  cq_attr.size = cq_size;
  cq_attr.wait_obj = FI_WAIT_FD;
  if (fi_cq_open(domain_, &cq_attr, &cq_, nullptr) == 0) {
    if (fi_control(&cq_->fid, FI_GETWAIT, &wait_fd_) != 0) wait_fd_ = -1;
  } else {
    cq_attr.wait_obj = FI_WAIT_NONE;
    FI_CHECK(fi_cq_open(domain_, &cq_attr, &cq_, nullptr), "fi_cq_open(", dom, ")");
  }

  fi_av_attr av_attr{};
  av_attr.type = FI_AV_TABLE;
  FI_CHECK(fi_av_open(domain_, &av_attr, &av_, nullptr), "fi_av_open(", dom, ")");

  fi_eq_attr eq_attr{};
  eq_attr.size = 64;
  eq_attr.wait_obj = FI_WAIT_NONE;
  FI_CHECK(fi_eq_open(fabric_, &eq_attr, &eq_, nullptr), "fi_eq_open(", dom, ")");

  FI_CHECK(fi_endpoint(domain_, info_.get(), &ep_, nullptr), "fi_endpoint(", dom, ")");
  FI_CHECK(fi_ep_bind(ep_, &cq_->fid, FI_TRANSMIT | FI_RECV), "binding the CQ on ", dom);
  FI_CHECK(fi_ep_bind(ep_, &av_->fid, 0), "binding the AV on ", dom);
  // NOTE: EFA calls abort() on asynchronous errors unless an EQ is bound; providers that
  // have no use for one may refuse it, which is harmless.
  if (const int rc = fi_ep_bind(ep_, &eq_->fid, 0))
    P2P_LOG(Debug, "no EQ bound on ", dom, ": ", fi_error_name(-rc));
  FI_CHECK(fi_enable(ep_), "fi_enable(", dom, ")");

  char name[256];
  size_t len = sizeof name;
  FI_CHECK(fi_getname(&ep_->fid, name, &len), "fi_getname(", dom, ")");
  address_.assign(name, len);
  if (info_->tx_attr->op_flags & FI_DELIVERY_COMPLETE) completion_flags_ = FI_DELIVERY_COMPLETE;
  // NOTE: with QueryOptions::shm_fast (TORCH_P2P_SHM_FAST=1), shm writes host memory on its unchecked "fast RMA" path
  // (info.cpp hints()) only without FI_DELIVERY_COMPLETE: through the target's command queue,
  // which the target must progress, 10k 4 KiB writes took seconds, not tens of ms, here.
  const std::string prov = info_->fabric_attr->prov_name;
  const bool shm_fast = profile(prov).unchecked_fast_rma && options.shm_fast;
  host_completion_flags_ = shm_fast ? 0 : completion_flags_;
  peers_must_release_ = profile(prov).peers_must_release;
  target_progress_ = profile(prov).target_progress;
  cuda_ipc_ = wants_cuda_ipc(prov, options);
  // Several segments per op cut the per-op cost of small pages (tcp allows 4). Not on the shm
  // fast path: it takes one remote segment only.
  max_iov_ = shm_fast ? 1 : std::max<size_t>(1, std::min(info_->tx_attr->iov_limit, info_->tx_attr->rma_iov_limit));
  efa_shaped_ = options.efa_shaped;
  if (efa_shaped_) max_iov_ = EfaShape::kRmaIov;
  shares_own_endpoints_ = profile(prov).shares_own_endpoints;
  if (shares_own_endpoints_) own_endpoints().opened();
}

Rail::~Rail() {
  // The endpoint goes first: closing it cancels what is still posted.
  auto close = [ep = ep_, av = av_, cq = cq_, eq = eq_, domain = domain_, fabric = fabric_]() mutable {
    close_fid(ep);
    close_fid(av);
    close_fid(cq);
    close_fid(eq);
    close_fid(domain);
    close_fid(fabric);
  };
  if (shares_own_endpoints_)
    own_endpoints().closing(address_, std::move(close));
  else
    close();
}

fi_addr_t Rail::insert(const std::string& raw_address) {
  auto it = av_entries_.find(raw_address);
  if (it != av_entries_.end()) {
    ++it->second.users;
    return it->second.addr;
  }
  P2P_CHECK(!shares_own_endpoints_ || !own_endpoints().closed(raw_address), ErrorKind::Peer,
            "the address names an endpoint on ", domain_name(), " of an engine of this process that has closed");
  fi_addr_t addr = FI_ADDR_NOTAVAIL;
  const int n = fi_av_insert(av_, raw_address.data(), 1, &addr, 0, nullptr);
  P2P_CHECK(n == 1, ErrorKind::Peer, "fi_av_insert on ", domain_name(),
            " rejected a peer address (", n < 0 ? fi_error_name(-n) : "0 inserted", ")");
  av_entries_.emplace(raw_address, AvEntry{addr, 1});
  return addr;
}

fi_addr_t Rail::cut(fi_addr_t addr) {
  for (auto& [raw, entry] : av_entries_) {
    if (entry.addr != addr) continue;
    fi_av_remove(av_, &addr, 1, 0);
    fi_addr_t again = FI_ADDR_NOTAVAIL;
    const int n = fi_av_insert(av_, raw.data(), 1, &again, 0, nullptr);
    P2P_CHECK(n == 1, ErrorKind::Peer, "fi_av_insert on ", domain_name(), " rejected a peer address again (",
              n < 0 ? fi_error_name(-n) : "0 inserted", ")");
    entry.addr = again;
    return again;
  }
  return addr;
}

MrHandle Rail::register_memory(void* ptr, size_t len, uint64_t access, int cuda_device, const DmaBuf* dmabuf) {
  const uint64_t mr_mode = info_->domain_attr->mr_mode;
  iovec iov{ptr, len};
  // Zeroed past the end of the struct these headers declare: a runtime of a later API version
  // reads the fields it added (1.20: hmem_data, page_size, base_mr, sub_mr_cnt) as unset.
  struct {
    fi_mr_attr attr;
    char later_fields[64];
  } padded{};
  fi_mr_attr& attr = padded.attr;
  fi_mr_dmabuf buf{};
  uint64_t flags = 0;
  if (dmabuf) {  // fi_mr(3), 1.20: the union's dmabuf member stands where mr_iov does
    buf = {dmabuf->fd, dmabuf->offset, dmabuf->len, dmabuf->base};
    attr.mr_iov = reinterpret_cast<const iovec*>(&buf);
    flags |= FI_MR_DMABUF;
  } else {
    attr.mr_iov = &iov;
  }
  attr.iov_count = 1;
  attr.access = access;
  attr.iface = cuda_device >= 0 ? FI_HMEM_CUDA : FI_HMEM_SYSTEM;
  attr.device.cuda = cuda_device >= 0 ? cuda_device : 0;

  MrHandle h;
  int rc = 0;
  // Without FI_MR_PROV_KEY the key is ours and must be unique in the domain (tcp refuses a
  // duplicate with -FI_ENOKEY): draw another on collision.
  for (int attempt = 0; attempt < 8; ++attempt) {
    attr.requested_key = random_key(efa_shaped_ ? EfaShape::kKeyBytes : info_->domain_attr->mr_key_size);
    rc = fi_mr_regattr(domain_, &attr, flags | (cuda_device >= 0 && cuda_ipc_ ? FI_HMEM_DEVICE_ONLY : 0), &h.mr);
    if (rc != -FI_ENOKEY) break;
  }
  FI_CHECK(rc, "registering ", len, " bytes of ", cuda_device >= 0 ? "CUDA" : "host", " memory",
           dmabuf ? " by dma-buf" : "", " on ", domain_name());
  if (mr_mode & FI_MR_ENDPOINT) {
    FI_CHECK(fi_mr_bind(h.mr, &ep_->fid, 0), "fi_mr_bind on ", domain_name());
    FI_CHECK(fi_mr_enable(h.mr), "fi_mr_enable on ", domain_name());
  }
  h.key = fi_mr_key(h.mr);
  h.desc = fi_mr_desc(h.mr);
  // Without FI_MR_VIRT_ADDR peers name offsets from the registration's first byte, which a
  // dma-buf's may place before ptr (it covers whole host pages).
  const uint64_t first = dmabuf ? reinterpret_cast<uint64_t>(dmabuf->base) : reinterpret_cast<uint64_t>(ptr);
  h.base = (mr_mode & FI_MR_VIRT_ADDR) ? reinterpret_cast<uint64_t>(ptr) : reinterpret_cast<uint64_t>(ptr) - first;
  return h;
}

void Rail::deregister(MrHandle& handle) { close_fid(handle.mr); }

namespace {

fi_msg_rma rma_message(const iovec* iov, void** desc, size_t n, fi_addr_t dest, const fi_rma_iov* rma,
                       void* context) {
  fi_msg_rma msg{};
  msg.msg_iov = iov;
  msg.desc = desc;
  msg.iov_count = n;
  msg.addr = dest;
  msg.rma_iov = rma;
  msg.rma_iov_count = n;
  msg.context = context;
  return msg;
}

}  // namespace

// What EFA would refuse (EfaShape): more than one iov, more than its largest RMA, no local
// descriptor (FI_MR_LOCAL), a key wider than 4 bytes, or remote CQ data.
ssize_t Rail::efa_refuses(const iovec* iov, void** desc, size_t n, const fi_rma_iov* rma, uint64_t flags) const {
  if (n > EfaShape::kRmaIov || (flags & FI_REMOTE_CQ_DATA)) return -FI_EINVAL;
  for (size_t i = 0; i < n; ++i) {
    if (iov[i].iov_len > EfaShape::kMaxRma) return -FI_EMSGSIZE;
    if (!desc || !desc[i] || rma[i].key >> (8 * EfaShape::kKeyBytes)) return -FI_EINVAL;
  }
  return 0;
}

ssize_t Rail::write(const iovec* iov, void** desc, size_t n, fi_addr_t dest, const fi_rma_iov* rma,
                    void* context, uint64_t flags, bool device) {
  if (efa_shaped_)
    if (const ssize_t rc = efa_refuses(iov, desc, n, rma, flags)) return rc;
  const fi_msg_rma msg = rma_message(iov, desc, n, dest, rma, context);
  return fi_writemsg(ep_, &msg, flags | (device ? completion_flags_ : host_completion_flags_));
}

ssize_t Rail::read(const iovec* iov, void** desc, size_t n, fi_addr_t dest, const fi_rma_iov* rma,
                   void* context, uint64_t flags) {
  if (efa_shaped_)
    if (const ssize_t rc = efa_refuses(iov, desc, n, rma, flags)) return rc;
  const fi_msg_rma msg = rma_message(iov, desc, n, dest, rma, context);
  return fi_readmsg(ep_, &msg, flags);
}

ssize_t Rail::send(void* buf, size_t len, void* desc, fi_addr_t dest, void* context) {
  return fi_send(ep_, buf, len, desc, dest, context);
}

ssize_t Rail::recv(void* buf, size_t len, void* desc, void* context) {
  return fi_recv(ep_, buf, len, desc, FI_ADDR_UNSPEC, context);
}

ssize_t Rail::poll(fi_cq_data_entry* entries, size_t n) {
  const ssize_t rc = fi_cq_read(cq_, entries, n);
  return rc == -FI_EAGAIN ? 0 : rc;
}

bool Rail::read_error(fi_cq_err_entry& entry, std::string& message) {
  entry = fi_cq_err_entry{};
  if (fi_cq_readerr(cq_, &entry, 0) != 1) return false;
  const char* prov = fi_cq_strerror(cq_, entry.prov_errno, entry.err_data, nullptr, 0);
  message = cat(fi_error_name(entry.err), " on ", domain_name(), ", provider error ",
                entry.prov_errno, prov ? cat(" (", prov, ")") : std::string());
  return true;
}

bool Rail::trywait() {
  if (wait_fd_ < 0) return false;
  fid* f = &cq_->fid;
  return fi_trywait(fabric_, &f, 1) == 0;
}

}  // namespace p2p::fabric
