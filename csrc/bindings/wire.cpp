// The wire records and messages as dicts, for tests and tools (tests/test_messages.py,
// tests/peer_helpers.py): decode validates as the engine does; encode writes any field values,
// valid or not (it checks nothing), with every CRC right.
#include <torch/csrc/utils/pybind.h>  // pybind11 with torch's casters (IntArrayRef)

#include "bindings/bindings.h"
#include "common/error.h"
#include "common/wire.h"
#include "core/address.h"
#include "core/messages.h"
#include "engine/remote_view.h"
#include "routes/cuda_ipc/export.h"
#include "routes/fabric/messages.h"
#include "routes/staged/messages.h"
#ifdef WITH_CUDA
#include <c10/cuda/CUDAGuard.h>

#include "cuda/vmm.h"
#endif

namespace py = pybind11;

namespace p2p::bindings {

using namespace p2p::core;
using engine::RemoteView;

namespace {
// A control message's fields as the worker reads them (csrc/core/messages.h), for
// tests/test_messages.py.
void add_live(py::dict& f, const LiveRegions& live) {
  f["upto"] = live.upto;
  py::list ranges;
  for (auto [first, last] : live.ranges) ranges.append(py::make_tuple(first, last));
  f["ranges"] = ranges;
}
py::bytes bytes_of(std::string_view v) { return py::bytes(v.data(), v.size()); }
void add_fields(py::dict& f, const Hello& m) {
  f["address"] = bytes_of(m.address);
  add_live(f, m.live);
}
void add_fields(py::dict& f, const HelloAck& m) {
  f["address"] = bytes_of(m.address);
  f["expected"] = m.expected;
  add_live(f, m.live);
}
void add_fields(py::dict& f, const Bye& m) { f["closing"] = m.closing; }
void add_fields(py::dict& f, const UserFragment& m) {
  f["id"] = m.id;
  f["total"] = m.total;
  f["offset"] = m.offset;
  f["part"] = bytes_of(m.part);
}
void add_fields(py::dict& f, const UserAck& m) { f["id"] = m.id; }
void add_fields(py::dict& f, const staged::StageRequest& m) {
  f["request"] = m.request;
  f["dir"] = m.dir;
  f["region"] = m.region_id;
  f["bytes"] = m.bytes;
  f["base"] = m.base;
  f["key"] = m.key;
  f["slot"] = m.slot;
  py::list runs;
  for (const Run& r : m.runs) runs.append(py::make_tuple(r.remote, r.len));
  f["runs"] = runs;
}
template <class M>  // Notify, staged::StageAck
auto add_fields(py::dict& f, const M& m) -> decltype(m.kind, void()) {
  f["id"] = m.id;
  f["kind"] = static_cast<int>(m.kind);
  f["message"] = bytes_of(m.message);
}
template <MsgType T>
void add_fields(py::dict& f, const IdMessage<T>& m) { f["id"] = m.id; }
void add_fields(py::dict& f, const RouteMessage& m) {
  f["route"] = m.route;
  f["body"] = bytes_of(m.body);
}

// (type, from, to, fields, the bytes the message encodes back to).
py::tuple decode_message_fields(const py::bytes& data) {
  const std::string bytes(data);
  const Received m = decode_message(bytes);
  py::dict fields;
  std::visit([&](const auto& body) { add_fields(fields, body); }, m.body);
  const std::string again =
      std::visit([&](const auto& body) { return encode_message(body, m.header.from, m.header.to).str(); }, m.body);
  return py::make_tuple(static_cast<int>(m.header.type), m.header.from, m.header.to, fields, py::bytes(again));
}

// A staged route message's body (routes/staged/messages.h): (kind, fields, the bytes it
// encodes back to).
py::tuple decode_stage_message(const py::bytes& data) {
  const std::string bytes(data);
  ByteReader r(bytes, "staged message");
  const uint8_t kind = r.get<uint8_t>();
  py::dict fields;
  ByteWriter again;
  auto decoded = [&](const auto& m) {
    add_fields(fields, m);
    m.write(again);
  };
  if (kind == staged::kStageRequest)
    decoded(staged::StageRequest::read(r));
  else if (kind == staged::kStageAck)
    decoded(staged::StageAck::read(r));
  else
    r.fail("not a staged request or answer");
  return py::make_tuple(static_cast<int>(kind), fields, py::bytes(again.str()));
}

py::tuple decode_fabric_message(const py::bytes& data) {
  const std::string bytes(data);
  const routes::fabric::Message m = routes::fabric::read_message(bytes);
  py::dict fields;
  fields["transfer"] = m.transfer;
  return py::make_tuple(static_cast<int>(m.kind), fields, py::bytes(routes::fabric::write_message(m)));
}

py::dict address_fields(const EngineAddress& a) {
  py::dict d;
  d["provider"] = py::bytes(a.provider);
  d["incarnation"] = a.incarnation;
  py::list rails;
  for (const auto& r : a.rails) rails.append(py::bytes(r));
  d["rails"] = rails;
  d["host"] = py::bytes(a.host);
  d["pid"] = a.pid;
  d["routes"] = a.routes;
  return d;
}

// d[key] as a T, or `fallback` where d has no such key.
template <typename T>
T field(const py::dict& d, const char* key, T fallback = T{}) {
  return d.contains(key) ? d[key].cast<T>() : fallback;
}

py::bytes encode_address(const py::dict& d) {
  EngineAddress a;
  a.provider = field<std::string>(d, "provider");
  a.incarnation = field<uint64_t>(d, "incarnation");
  a.rails = field<std::vector<std::string>>(d, "rails");
  a.host = field<std::string>(d, "host");
  a.pid = field<uint32_t>(d, "pid");
  a.routes = field<uint8_t>(d, "routes");
  return py::bytes(a.encode());
}

py::dict remote_fields(const RemoteView& v) {
  const RemoteRegion& g = *v.region;
  py::dict region;
  region["owner"] = py::bytes(g.owner);
  region["id"] = g.id;
  region["nbytes"] = g.nbytes;
  region["access"] = g.access;
  region["staged"] = !g.on_nics;  // the wire's name for it
  region["device_type"] = g.device_type;
  region["device_index"] = g.device_index;
  region["piece_bytes"] = g.piece_bytes;
  region["rails"] = g.rails;
  py::list entries;
  for (size_t i = 0; i < g.base.size(); ++i) entries.append(py::make_tuple(g.base[i], g.key[i]));
  region["entries"] = entries;
  py::dict routes;
  for (const auto& [route, bytes] : g.route_bytes) routes[py::int_(route)] = py::bytes(bytes);
  region["route_bytes"] = routes;
  py::dict d;
  d["region"] = region;
  d["dtype"] = static_cast<int>(v.dtype);
  d["shape"] = c10::IntArrayRef(v.shape).vec();
  d["strides"] = c10::IntArrayRef(v.strides).vec();
  d["offset"] = v.offset;
  return d;
}

py::bytes encode_remote(const py::dict& d) {
  const py::dict r = d["region"].cast<py::dict>();
  auto g = std::make_shared<RemoteRegion>();
  g->owner = field<std::string>(r, "owner");
  g->id = field<uint64_t>(r, "id");
  g->nbytes = field<uint64_t>(r, "nbytes");
  g->access = field<uint8_t>(r, "access");
  g->on_nics = !field<bool>(r, "staged");
  g->device_type = field<int8_t>(r, "device_type");
  g->device_index = field<int16_t>(r, "device_index", -1);
  g->piece_bytes = field<uint64_t>(r, "piece_bytes");
  g->rails = field<uint16_t>(r, "rails");
  for (const auto& [base, key] : field<std::vector<std::pair<uint64_t, uint64_t>>>(r, "entries")) {
    g->base.push_back(base);
    g->key.push_back(key);
  }
  g->route_bytes = field<std::map<uint8_t, std::string>>(r, "route_bytes");
  RemoteView v;
  v.region = g;
  v.dtype = static_cast<c10::ScalarType>(field<int8_t>(d, "dtype"));
  const auto shape = field<std::vector<int64_t>>(d, "shape"), strides = field<std::vector<int64_t>>(d, "strides");
  v.shape.assign(shape.begin(), shape.end());
  v.strides.assign(strides.begin(), strides.end());
  v.offset = field<int64_t>(d, "offset");
  return py::bytes(v.encode());
}

}  // namespace

void bind_wire(py::module_& m) {
  // The control messages' wire format (tests/test_messages.py).
  m.def("_decode_message", &decode_message_fields);
  m.def("_decode_stage_message", &decode_stage_message);
  m.def("_decode_fabric_message", &decode_fabric_message);
  m.def("_decode_address", [](const py::bytes& b) { return address_fields(EngineAddress::decode(std::string(b))); });
  m.def("_encode_address", &encode_address);
  m.def("_decode_remote", [](const py::bytes& b) { return remote_fields(*RemoteView::decode(std::string(b))); });
  m.def("_encode_remote", &encode_remote);
  // The IPC route's export in a handle (RemoteRegion::route_bytes[0]), as the route reads it.
  m.def("_decode_ipc_export", [](const py::bytes& b, int8_t device_type) {
    const std::string bytes(b);
    const ipc::IpcExport x = ipc::IpcExport::decode(&bytes, device_type);
    py::dict d;
    d["kind"] = x.shared.kind == cuda::Export::Vmm ? "vmm" : "legacy";
    d["offset"] = x.shared.offset;
    d["ptr"] = x.ptr;
    return d;
  });
#ifdef WITH_CUDA
  // How many VMM mappings of `device` lie under [ptr, ptr + nbytes), and why none where there
  // are none.
  m.def("_vmm_layout", [](uint64_t ptr, uint64_t nbytes, int device) {
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));  // the driver asks the current context
    std::string why;
    const size_t n = cuda::vmm_layout(ptr, nbytes, why).size();
    return py::make_tuple(n, why);
  });
#endif
  // ByteWriter::seal and ByteReader::check_crc: a record's trailing CRC32 added or checked and dropped.
  m.def("_seal", [](const py::bytes& b) {
    ByteWriter w;
    w.str() = std::string(b);
    w.seal();
    return py::bytes(w.str());
  });
  m.def("_unseal", [](const py::bytes& b) {
    const std::string in(b);
    ByteReader r(in, "record");
    r.check_crc();
    return py::bytes(std::string(r.get_raw(r.remaining())));
  });
}

}  // namespace p2p::bindings
