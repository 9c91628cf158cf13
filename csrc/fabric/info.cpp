#include "fabric/info.h"

#include <rdma/fi_domain.h>
#include <rdma/fi_errno.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>

#include "common/error.h"
#include "common/log.h"
#include "fabric/profile.h"

namespace p2p::fabric {
namespace {

// NOTE: libfabric reads FI_AV_REMOVE_CLEANUP once, at its first query. With it, removing a
// peer's address tears down the connections under it (ofi_rxm closes the msg endpoint, whose
// provider flushes every posted op with FI_ECANCELED): the one way to take back, from tcp and
// verbs, the buffers of ops to a peer that stopped answering (Worker::peer_failed). Set when
// this library loads, before anything queries libfabric; a value the user set is kept.
const bool kAvRemoveCleanup = [] { return setenv("FI_AV_REMOVE_CLEANUP", "1", 0) == 0; }();

// NOTE: ask for the runtime's own API version (capped at one we have read the semantics
// of), never the compile-time one: EFA turns on device RDMA and FI_HMEM only for >= 1.18,
// and a 1.17 runtime refuses newer requests with -FI_ENOSYS.
uint32_t api_version(const QueryOptions& options) {
  if (options.api_version) return options.api_version;
  return std::min<uint32_t>(fi_version(), FI_VERSION(1, 22));
}

// Profile::auto_progress; manual progress (QueryOptions) keeps progress on the engine's own
// thread (measurements).
bool wants_auto_progress(const std::string& provider, const QueryOptions& options) {
  return !options.manual_progress && profile(provider).auto_progress;
}

InfoPtr hints(const std::string& provider, bool hmem, bool delivery_complete, bool auto_progress, bool shm_fast) {
  InfoPtr h(fi_allocinfo());
  P2P_CHECK(h, ErrorKind::Generic, "fi_allocinfo failed");
  h->caps = FI_MSG | FI_RMA | FI_SEND | FI_RECV | FI_READ | FI_WRITE | FI_REMOTE_READ |
            FI_REMOTE_WRITE | (hmem ? FI_HMEM : 0);
  h->ep_attr->type = FI_EP_RDM;
  h->mode = FI_CONTEXT | FI_CONTEXT2;
  // Every mr_mode bit this engine handles; each provider keeps the ones it needs.
  h->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY |
                            FI_MR_ENDPOINT | (hmem ? FI_MR_HMEM : 0);
  // The worker thread is the only user of a domain, unless the provider progresses on its own.
  h->domain_attr->threading = auto_progress ? FI_THREAD_SAFE : FI_THREAD_DOMAIN;
  if (auto_progress) h->domain_attr->data_progress = FI_PROGRESS_AUTO;
  // Control messages and message fragments rely on send-after-send order per peer.
  h->tx_attr->msg_order = FI_ORDER_SAS;
  h->rx_attr->msg_order = FI_ORDER_SAS;
  // Profile::unchecked_fast_rma: asking for any RMA ordering turns shm's unchecked path off for
  // the domain (smr_fast_rma_enabled, libfabric 1.17 to 2.6): RMA then goes through the
  // target's command queue, which verifies it.
  if (profile(provider).unchecked_fast_rma && !shm_fast) h->tx_attr->msg_order |= FI_ORDER_RAW;
  if (delivery_complete) h->tx_attr->op_flags = FI_DELIVERY_COMPLETE;
  if (!provider.empty()) h->fabric_attr->prov_name = strdup(provider.c_str());
  return h;
}

std::string available_providers(const QueryOptions& options) {
  InfoPtr h = hints("", false, false, false, options.shm_fast);
  fi_info* list = nullptr;
  std::set<std::string> names;
  if (fi_getinfo(api_version(options), nullptr, nullptr, 0, h.get(), &list) == 0) {
    for (fi_info* i = list; i; i = i->next) names.insert(i->fabric_attr->prov_name);
    fi_freeinfo(list);
  }
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out.empty() ? "none" : out;
}

}  // namespace

std::vector<Nic> Offer::nics() const {
  std::vector<Nic> out;
  std::set<std::string> seen;
  for (const fi_info* i = list.get(); i; i = i->next) {
    if (!seen.insert(i->domain_attr->name).second) continue;
    Nic nic{i->fabric_attr->prov_name, i->fabric_attr->name, i->domain_attr->name, "", 0};
    if (i->nic && i->nic->bus_attr && i->nic->bus_attr->bus_type == FI_BUS_PCI) {
      const auto& pci = i->nic->bus_attr->attr.pci;
      char bdf[32];
      std::snprintf(bdf, sizeof bdf, "%04x:%02x:%02x.%x", pci.domain_id, pci.bus_id, pci.device_id,
                    pci.function_id);
      nic.pci = bdf;
    }
    if (i->nic && i->nic->link_attr) nic.speed_bps = i->nic->link_attr->speed;
    out.push_back(std::move(nic));
  }
  return out;
}

const fi_info* Offer::domain(const std::string& name) const {
  for (const fi_info* i = list.get(); i; i = i->next)
    if (name == i->domain_attr->name) return i;
  return nullptr;
}

size_t Offer::max_rma() const {
  return options.efa_shaped ? EfaShape::kMaxRma : list->ep_attr->max_msg_size;
}

Limits limits(const fi_info& info) {
  Limits l;
  const uint64_t mode = info.domain_attr->mr_mode;
  const std::pair<uint64_t, const char*> bits[] = {
      {FI_MR_LOCAL, "FI_MR_LOCAL"},         {FI_MR_VIRT_ADDR, "FI_MR_VIRT_ADDR"}, {FI_MR_ALLOCATED, "FI_MR_ALLOCATED"},
      {FI_MR_PROV_KEY, "FI_MR_PROV_KEY"},   {FI_MR_ENDPOINT, "FI_MR_ENDPOINT"},   {FI_MR_HMEM, "FI_MR_HMEM"},
      {FI_MR_RAW, "FI_MR_RAW"},             {FI_MR_MMU_NOTIFY, "FI_MR_MMU_NOTIFY"}, {FI_MR_RMA_EVENT, "FI_MR_RMA_EVENT"}};
  for (const auto& [bit, name] : bits)
    if (mode & bit) l.mr_mode.push_back(name);
  l.iov_limit = info.tx_attr->iov_limit;
  l.rma_iov_limit = info.tx_attr->rma_iov_limit;
  l.inject_size = info.tx_attr->inject_size;
  l.max_msg_size = info.ep_attr->max_msg_size;
  l.cq_data_size = info.domain_attr->cq_data_size;
  l.mr_key_size = info.domain_attr->mr_key_size;
  l.dmabuf = (info.caps & FI_HMEM) && fi_version() >= FI_VERSION(1, 20);  // registration.h: whatever the headers
  return l;
}

Offer query(const std::string& provider, bool want_hmem, const QueryOptions& options) {
  std::vector<std::string> candidates{provider};
  if (provider.empty()) {
    const std::vector<const char*> names = default_providers();
    candidates.assign(names.begin(), names.end());
  }
  const uint32_t version = api_version(options);
  for (const auto& name : candidates) {
    // Prefer FI_HMEM, then delivery-complete; drop each only when the provider refuses it.
    const std::vector<bool> hmem_options = want_hmem ? std::vector{true, false} : std::vector{false};
    const std::vector<bool> progress_options =
        wants_auto_progress(name, options) ? std::vector{true, false} : std::vector{false};
    for (bool automatic : progress_options) {
      for (bool hmem : hmem_options) {
        for (bool dc : {true, false}) {
          InfoPtr h = hints(name, hmem, dc, automatic, options.shm_fast);
          fi_info* list = nullptr;
          if (fi_getinfo(version, nullptr, nullptr, 0, h.get(), &list) != 0) continue;
          Offer offer;
          offer.list.reset(list);
          offer.provider = list->fabric_attr->prov_name;
          offer.hmem = hmem;
          offer.delivery_complete = dc;
          offer.auto_progress = automatic;
          offer.api_version = version;
          offer.options = options;
          if (!dc)
            P2P_LOG(Warn, "provider ", offer.provider,
                    " refuses FI_DELIVERY_COMPLETE: a completed write means the bytes left this "
                    "host, not that they reached remote memory");
          return offer;
        }
      }
    }
  }
  if (provider.empty()) {
    std::string tried;
    for (const auto& name : candidates) tried += (tried.empty() ? "" : ", ") + name;
    P2P_THROW(ErrorKind::Value,
              "no libfabric provider with RDM endpoints and RMA found (tried ", tried, "); "
              "this machine offers: ", available_providers(options));
  }
  P2P_THROW(ErrorKind::Value, "libfabric provider '", provider,
            "' is not available with RDM endpoints and RMA; this machine offers: ",
            available_providers(options));
}

}  // namespace p2p::fabric
