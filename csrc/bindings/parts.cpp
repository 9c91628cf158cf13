// Engine parts that tests drive alone, without an engine or a process: the striper, the
// transfer state machine, the region table, one peer's liveness schedule, the counters of the
// paths work took, and the host copies the same-host route is measured against.
#include <torch/csrc/utils/pybind.h>  // pybind11 with torch's casters (at::Tensor)

#include <cstring>
#include <future>

#include "bindings/bindings.h"
#include "common/counters.h"
#include "common/error.h"
#include "common/wire.h"
#include "core/copies.h"
#include "core/liveness.h"
#include "core/region_table.h"
#include "core/runs.h"
#include "core/striper.h"
#include "core/transfer.h"

namespace py = pybind11;

namespace p2p::bindings {

using namespace p2p::core;

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

}  // namespace

void bind_parts(py::module_& m) {
  // The paths work took in this process (common/counters.h; tests of the settings that choose them).
  m.def("_counters", [] {
    py::dict d;
#define P2P_COUNTER_ENTRY(name, key) d[#key] = counted(Counter::name);
    P2P_COUNTERS(P2P_COUNTER_ENTRY)
#undef P2P_COUNTER_ENTRY
    return d;
  });
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

  // The region table (csrc/core/region_table.h; tests/test_region_table.py).
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

  // One peer's liveness schedule (csrc/core/liveness.h) on a clock the caller passes, for
  // tests/test_liveness.py.
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

}  // namespace p2p::bindings
