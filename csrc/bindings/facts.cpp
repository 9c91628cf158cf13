// What the provider grants and what the engine does on it (csrc/fabric), the NICs and the
// settings table, for engine.py's defaults, doctor and topology.
#include "bindings/facts.h"

#include "bindings/bindings.h"
#include "common/error.h"
#include "core/config.h"
#include "fabric/profile.h"
#include "fabric/registration.h"

namespace p2p::bindings {

using fabric::Limits;
using fabric::Profile;
using core::RailFacts;

namespace {

const auto kLimitFields =
    std::make_tuple(P2P_FIELD(Limits, mr_mode), P2P_FIELD(Limits, iov_limit), P2P_FIELD(Limits, rma_iov_limit),
                    P2P_FIELD(Limits, inject_size), P2P_FIELD(Limits, max_msg_size), P2P_FIELD(Limits, cq_data_size),
                    P2P_FIELD(Limits, mr_key_size), P2P_FIELD(Limits, dmabuf));

// known_problem is null where there is none: None in Python, as pybind11 casts a null char*.
const auto kProfileFields = std::make_tuple(
    P2P_FIELD(Profile, name), P2P_FIELD(Profile, default_rank), P2P_FIELD(Profile, remote), P2P_FIELD(Profile, rdma),
    P2P_FIELD(Profile, dmabuf), P2P_FIELD(Profile, auto_progress), P2P_FIELD(Profile, rails_from_cores),
    P2P_FIELD(Profile, max_chunk), P2P_FIELD(Profile, unchecked_fast_rma), P2P_FIELD(Profile, cuda_ipc_rma),
    P2P_FIELD(Profile, own_endpoint_names), P2P_FIELD(Profile, peers_must_release),
    P2P_FIELD(Profile, target_progress), P2P_FIELD(Profile, shares_own_endpoints),
    P2P_FIELD(Profile, known_problem));

const auto kRailFields = std::make_tuple(P2P_FIELD(RailFacts, domain), P2P_FIELD(RailFacts, fabric),
                                         P2P_FIELD(RailFacts, tx_depth), P2P_FIELD(RailFacts, wait_fd),
                                         P2P_FIELD(RailFacts, cuda_ipc));

// The settings of the environment only: what a query outside an engine uses.
core::Config environment() {
  core::Config c;
  core::read_environment(c, {"provider"});
  return c;
}

py::dict provider_limits(const std::string& provider) {
  fabric::Offer offer = fabric::query(provider, true, environment().query_options());
  py::dict d;
  d["provider"] = offer.provider;
  d["fabric"] = std::string(offer.list->fabric_attr->name);
  d["hmem"] = offer.hmem;
  d["delivery_complete"] = offer.delivery_complete;
  d["auto_progress"] = offer.auto_progress;
  put_fields(d, fabric::limits(*offer.list), kLimitFields);
  d["nics"] = nic_list(offer);
  return d;
}

py::dict provider_profile(const std::string& provider) {
  py::dict d;
  put_fields(d, fabric::profile(provider), kProfileFields);
  return d;
}

py::tuple registration(const std::string& provider, bool hmem, bool dmabuf, const std::string& memory) {
  using fabric::MemoryKind;
  const MemoryKind kind = memory == "host" ? MemoryKind::Host : memory == "cuda" ? MemoryKind::Cuda
                          : memory == "cuda_vmm" ? MemoryKind::CudaVmm
                          : throw Error(ErrorKind::Value, cat("memory must be 'host', 'cuda' or 'cuda_vmm', not '", memory, "'"));
  const fabric::RegistrationChoice c = fabric::choose_registration(fabric::profile(provider), hmem, dmabuf, kind);
  return py::make_tuple(fabric::name(c.how), c.why);
}

}  // namespace

py::list nic_list(const fabric::Offer& offer) {
  py::list nics;
  for (const auto& n : offer.nics()) {
    py::dict d;
    d["domain"] = n.domain;
    d["fabric"] = n.fabric;
    d["pci"] = n.pci.empty() ? py::object(py::none()) : py::object(py::str(n.pci));  // not a PCI device
    d["speed_bps"] = n.speed_bps ? py::object(py::int_(n.speed_bps)) : py::object(py::none());  // unknown
    nics.append(d);
  }
  return nics;
}

py::list rail_list(const std::vector<RailFacts>& rails) {
  py::list out;
  for (const RailFacts& r : rails) {
    py::dict d;
    put_fields(d, r, kRailFields);
    out.append(d);
  }
  return out;
}

void bind_facts(py::module_& m) {
  m.def("libfabric_version", [] {
    const uint32_t v = fi_version();
    return py::make_tuple(FI_MAJOR(v), FI_MINOR(v));
  }, "(major, minor) of the libfabric loaded at run time.");
  m.def("list_nics", [](const std::string& provider, bool want_hmem) {
    fabric::Offer offer = fabric::query(provider, want_hmem, environment().query_options());
    return py::make_tuple(offer.provider, offer.hmem, nic_list(offer));
  }, py::arg("provider"), py::arg("want_hmem"),
     "Resolves a provider name and lists its NICs: (provider, hmem, [nic dicts]).");
  m.def("provider_limits", &provider_limits, py::arg("provider"),
        "What a provider grants the engine's query: its limits, modes and NICs (a dict).");
  m.def("provider_profile", &provider_profile, py::arg("provider"),
        "What the engine does differently on a provider (csrc/fabric/profile.h), a dict.");
  m.def("registration", &registration, py::arg("provider"), py::arg("hmem"), py::arg("dmabuf"), py::arg("memory"),
        "How memory of a kind registers with a provider whose answer has FI_HMEM (hmem) and FI_MR_DMABUF (dmabuf): "
        "(\"host\" | \"hmem\" | \"dmabuf\" | \"staged\", why). csrc/fabric/registration.h.");
  m.def("provider_names", [] {
    std::vector<std::string> names;
    for (const fabric::Profile& p : fabric::profiles()) names.push_back(p.name);
    return names;
  }, "The providers the profile table knows.");
  m.def("default_providers", &fabric::default_providers, "What Engine(provider=None) tries, in order.");
  m.def("settings", [] {
    py::list rows;
    for (const core::SettingInfo& r : core::setting_table()) rows.append(py::make_tuple(r.key, r.variable, r.default_text));
    return rows;
  }, "The settings table (csrc/core/config.h): [(key, TORCH_P2P_* variable or '', default as text)].");
}

}  // namespace p2p::bindings
