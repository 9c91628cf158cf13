#include "bindings_internal.h"

#include <torch/csrc/utils/pybind.h>  // pybind11 with torch's casters (at::Tensor); not all of torch/extension.h

#include <cstring>

#include "common/counters.h"
#include "common/error.h"
#include "common/wire.h"
#include "core/address.h"
#include "core/copies.h"
#include "core/liveness.h"
#include "core/messages.h"
#include "core/region_table.h"
#include "core/runs.h"
#include "core/striper.h"
#include "core/transfer.h"
#include "engine/remote_view.h"
#include "routes/cuda_ipc/export.h"
#include "routes/fabric/messages.h"
#ifdef WITH_CUDA
#include <c10/cuda/CUDAGuard.h>

#include "cuda/vmm.h"
#endif
#include "routes/staged/messages.h"

namespace py = pybind11;
using namespace p2p::engine;
using namespace p2p::core;

namespace p2p {
namespace {

using RunTuple = std::tuple<uint64_t, uint64_t, uint64_t, uint32_t, uint32_t>;

std::vector<Run> to_runs(const std::vector<RunTuple>& tuples) {
  std::vector<Run> runs;
  for (const auto& [local, remote, len, lreg, rreg] : tuples) runs.push_back({local, remote, len, lreg, rreg});
  return runs;
}

// The ops the direct route makes of `runs`, for tests: (chunk, [(local rail, remote rail,
// [(run, offset, len, local piece, remote piece, offset in remote piece)])]).
py::tuple stripe(const std::vector<RunTuple>& tuples, const std::vector<std::pair<uint64_t, uint64_t>>& local,
                 const std::vector<uint64_t>& remote, size_t local_rails, size_t remote_rails, uint64_t min_chunk,
                 uint64_t max_chunk, size_t max_iov) {
  const std::vector<Run> runs = to_runs(tuples);
  P2P_CHECK(local_rails > 0 && remote_rails > 0 && max_iov > 0 && min_chunk > 0, ErrorKind::Value, "bad geometry");
  for (const Run& r : runs)
    P2P_CHECK(r.lreg < local.size() && r.rreg < remote.size(), ErrorKind::Value, "a run names no region");
  for (const auto& [base, piece] : local) P2P_CHECK(piece > 0, ErrorKind::Value, "piece_bytes must be positive");
  for (uint64_t piece : remote) P2P_CHECK(piece > 0, ErrorKind::Value, "piece_bytes must be positive");
  Striper striper(min_chunk, max_chunk);
  uint64_t total = 0;
  for (const Run& r : runs) total += r.len;
  const uint64_t chunk = striper.chunk(total, Striper::pairs(local_rails, remote_rails));
  auto local_extent = [&](uint32_t i) { return Extent{local[i].first, local[i].second}; };
  auto remote_extent = [&](uint32_t i) { return Extent{0, remote[i]}; };
  py::list ops;
  RunCursor at;
  while (!at.at_end(runs)) {
    const RailPair pair = striper.pair(local_rails, remote_rails);
    Segment segs[kMaxIov];
    const size_t n = Striper::fill(at, runs, local_extent, remote_extent, chunk, std::min(max_iov, kMaxIov), segs);
    py::list out;
    for (size_t i = 0; i < n; ++i)
      out.append(py::make_tuple(segs[i].run, segs[i].offset, segs[i].len, segs[i].lpiece, segs[i].rpiece,
                                segs[i].rpiece_offset));
    ops.append(py::make_tuple(pair.local, pair.remote, out));
    striper.next();
  }
  return py::make_tuple(chunk, ops);
}

// The slot jobs the staged route makes of `runs`: [(bytes, [run tuples])].
py::list stripe_slots(const std::vector<RunTuple>& tuples, size_t max_runs, uint64_t slot_bytes) {
  P2P_CHECK(max_runs > 0 && slot_bytes > 0, ErrorKind::Value, "bad slot geometry");
  const std::vector<Run> runs = to_runs(tuples);
  py::list jobs;
  RunCursor at;
  while (!at.at_end(runs)) {
    std::vector<Run> taken;
    const uint64_t bytes = Striper::fill_slot(at, runs, max_runs, slot_bytes, taken);
    py::list out;
    for (const Run& r : taken) out.append(py::make_tuple(r.local, r.remote, r.len, r.lreg, r.rreg));
    jobs.append(py::make_tuple(bytes, out));
  }
  return jobs;
}

TransferState state_named(const std::string& text) {
  for (int i = 0; i <= static_cast<int>(TransferState::Reported); ++i)
    if (text == name(static_cast<TransferState>(i))) return static_cast<TransferState>(i);
  throw Error(ErrorKind::Value, "no transfer state " + text);
}

// Transfer::next_step for a transfer in `state` with these facts, for tests.
std::string transfer_next_step(const std::string& state, bool message, bool ok, bool held, bool acked,
                               size_t pending, bool needs_confirm) {
  Transfer t;
  t.state = state_named(state);
  t.kind = message ? TransferKind::Message : TransferKind::Write;
  if (!ok) t.status = Status::error(ErrorKind::Peer, "failed");
  t.held = held;
  t.acked = acked;
  t.pending = pending;
  return name(t.next_step(needs_confirm));
}

// Whether Transfer::enter allows the move, for tests.
bool transfer_may_enter(const std::string& from, const std::string& to) {
  Transfer t;
  t.state = state_named(from);
  try {
    t.enter(state_named(to));
    return true;
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::Value) throw;
    return false;
  }
}

// Private bindings of engine parts that tests drive alone, without an engine or a process.
// A RegionTable of regions that hold no memory, for tests of when a closing region goes.
class RegionTableHarness {
 public:
  uint64_t add() {
    auto r = std::make_shared<Region>();
    r->id = table_.next_id();
    table_.add(r);
    return r->id;
  }
  void hold(uint64_t id) { held_[id] = table_.find(id); }  // a local operation uses it
  void drop(uint64_t id) { held_.erase(id); }
  bool close(uint64_t id, double deadline) {
    auto done = std::make_shared<std::promise<void>>();
    answers_[id].push_back(done->get_future());
    return table_.close(id, std::move(done), deadline);
  }
  // How many close() calls on `id` have been answered.
  size_t answered(uint64_t id) {
    size_t n = 0;
    for (auto& f : answers_[id]) n += f.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
    return n;
  }
  std::vector<uint64_t> finish(double now) {
    std::vector<uint64_t> gone;
    table_.finish(now, [&](Region& r) { gone.push_back(r.id); });
    return gone;
  }
  // As a peer reads it from a HELLO.
  py::tuple live() const {
    ByteWriter w;
    table_.live().write(w);
    ByteReader r(w.str(), "live regions");
    const LiveRegions live = LiveRegions::read(r);
    py::list ranges;
    for (auto [first, last] : live.ranges) ranges.append(py::make_tuple(first, last));
    return py::make_tuple(live.upto, ranges);
  }
  RegionTable table_;

 private:
  std::unordered_map<uint64_t, std::shared_ptr<Region>> held_;
  std::unordered_map<uint64_t, std::vector<std::future<void>>> answers_;
};

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

// dst[dst_ids[i]] = src[src_ids[i]] for rows of two contiguous 2-D host tensors, one memcpy per
// row on this thread: the single-core ceiling the same-host host route is measured against.
void copy_rows(at::Tensor dst, const std::vector<int64_t>& dst_ids, at::Tensor src,
               const std::vector<int64_t>& src_ids) {
  P2P_CHECK(dst.dim() == 2 && src.dim() == 2 && dst.is_contiguous() && src.is_contiguous() && !dst.is_cuda() &&
                !src.is_cuda() && dst.size(1) == src.size(1) && dst.dtype() == src.dtype() &&
                dst_ids.size() == src_ids.size(),
            ErrorKind::Value, "copy_rows takes two contiguous 2-D host tensors of equal rows and equal id lists");
  const size_t row = dst.size(1) * dst.element_size();
  for (int64_t id : dst_ids) P2P_CHECK(id >= 0 && id < dst.size(0), ErrorKind::Index, "row ", id, " out of range");
  for (int64_t id : src_ids) P2P_CHECK(id >= 0 && id < src.size(0), ErrorKind::Index, "row ", id, " out of range");
  auto* d = static_cast<uint8_t*>(dst.data_ptr());
  const auto* s = static_cast<const uint8_t*>(src.data_ptr());
  py::gil_scoped_release release;
  for (size_t i = 0; i < dst_ids.size(); ++i) std::memcpy(d + dst_ids[i] * row, s + src_ids[i] * row, row);
}

// The cma route's copy of (local address, remote address, bytes) spans into (write) or out of
// process `pid`, on this thread: its errno, 0 when every byte moved.
int cma_copy(int pid, const std::vector<std::tuple<uint64_t, uint64_t, uint64_t>>& spans, bool write) {
  std::vector<core::Span> s;
  for (const auto& [local, remote, len] : spans) s.push_back({reinterpret_cast<uint8_t*>(local), remote, len});
  py::gil_scoped_release release;
  return core::copy_spans(pid, s.data(), s.size(), write);
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

}  // namespace

void bind_parts(py::module_& m) {
  // The paths work took in this process (common/counters.h; tests of the settings that choose them).
  m.def("_counters", [] {
    py::dict d;
    d["ipc_copy_engine_spans"] = counted(Counter::IpcCopyEngineSpans);
    d["ipc_kernel_spans"] = counted(Counter::IpcKernelSpans);
    d["fences"] = counted(Counter::Fences);
    return d;
  });
  // The control messages' wire format (tests/test_messages.py).
  m.def("_decode_message", &decode_message_fields);
  m.def("_decode_stage_message", &decode_stage_message);
  m.def("_decode_fabric_message", &decode_fabric_message);
  m.def("_copy_rows", &copy_rows, py::arg("dst"), py::arg("dst_ids"), py::arg("src"), py::arg("src_ids"));
  m.def("_cma_copy", &cma_copy, py::arg("pid"), py::arg("spans"), py::arg("write"));
  // The striper (tests/test_striper.py).
  m.def("_stripe", &stripe);
  m.def("_stripe_slots", &stripe_slots);
  m.def("_slot_size", &slot_size);
  // The transfer state machine (csrc/core/transfer.h; tests/test_transfer_state.py).
  m.def("_transfer_next_step", &transfer_next_step, py::arg("state"), py::arg("message"), py::arg("ok"),
        py::arg("held"), py::arg("acked"), py::arg("pending"), py::arg("needs_confirm"));
  m.def("_transfer_may_enter", &transfer_may_enter);

  // One peer's liveness schedule (csrc/core/liveness.h) on a clock the caller
  // passes, for tests/test_liveness.py.
  py::class_<RegionTableHarness>(m, "_RegionTable")
      .def(py::init<>())
      .def("add", &RegionTableHarness::add)
      .def("hold", &RegionTableHarness::hold)
      .def("drop", &RegionTableHarness::drop)
      .def("close", &RegionTableHarness::close, py::arg("id"), py::arg("deadline"))
      .def("answered", &RegionTableHarness::answered)
      .def("must_release", [](RegionTableHarness& h, uint64_t id, uint64_t peer) { h.table_.must_release(id, peer); },
           py::arg("id"), py::arg("peer"))
      .def("released", [](RegionTableHarness& h, uint64_t id, uint64_t peer) { h.table_.released(id, peer); },
           py::arg("id"), py::arg("peer"))
      .def("forget_peer", [](RegionTableHarness& h, uint64_t peer) { h.table_.forget_peer(peer); }, py::arg("peer"))
      .def("finish", &RegionTableHarness::finish, py::arg("now"))
      .def("live", &RegionTableHarness::live);

  py::class_<Liveness>(m, "_Liveness")
      .def(py::init<double>(), py::arg("timeout"))
      .def_property_readonly("state", [](const Liveness& l) { return name(l.state()); })
      .def_property_readonly("waits", &Liveness::waits)
      .def_property_readonly("checking", &Liveness::checking)
      .def_property_readonly("last_heard", &Liveness::last_heard)
      .def("connect", &Liveness::connect, py::arg("now"))
      .def("answered", &Liveness::answered)
      .def("fail", [](Liveness& l, bool left) { l.fail(left ? PeerState::Left : PeerState::Dead); },
           py::arg("left") = false)
      .def("start_check", &Liveness::start_check, py::arg("deadline"))
      .def("heard", &Liveness::heard, py::arg("now"))
      .def("watch_from", &Liveness::watch_from, py::arg("now"))
      .def("hello_failed", [](Liveness& l, double now, bool transient) {
        const Liveness::Retry r = l.hello_failed(now, transient);
        return py::make_tuple(r == Liveness::Retry::Ignore ? "Ignore" : r == Liveness::Retry::Later ? "Later" : "GiveUp",
                              l.retry_at());
      }, py::arg("now"), py::arg("transient"))
      .def("tick", [](Liveness& l, double now, bool busy) {
        const Liveness::Due due = l.tick(now, busy);
        const char* verdict = due.verdict == Liveness::Verdict::Alive        ? "Alive"
                              : due.verdict == Liveness::Verdict::Unanswered ? "Unanswered"
                                                                              : "Silent";
        return py::make_tuple(due.send_hello, verdict);
      }, py::arg("now"), py::arg("busy"));
}

// The wire records (csrc/core/address.h, engine/remote_view.h) as dicts, for tests and tools that
// forge handles: decode validates as the engine does; encode writes any field values, valid
// or not (it checks nothing), with every CRC right.
namespace {

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

// Private bindings of the wire records, for tests and tools (tests/peer_helpers.py).
}  // namespace

void bind_wire(py::module_& m) {
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

}  // namespace p2p
