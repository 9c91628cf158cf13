// The only file that knows pybind11: wraps engine::Engine and engine::RemoteView as
// torch_p2p._C, and turns p2p::Error into the Python exception its kind names.
#include <torch/extension.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include "common/error.h"
#include "common/wire.h"
#include "engine/config.h"
#include "engine/engine.h"
#include "engine/striper.h"
#include "fabric/info.h"

namespace py = pybind11;
using namespace p2p;
using namespace p2p::engine;

namespace {

// Messages may quote bytes from peers or users: decode them leniently.
py::str text(const std::string& message) { return py::bytes(message).attr("decode")("utf-8", "replace"); }

// The exception an error's kind names (errors.from_kind reads the kind table, error_kinds).
void raise(const Error& e) {
  py::object exc = py::module_::import("torch_p2p.errors").attr("from_kind")(static_cast<int>(e.kind()), text(e.what()));
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
}

py::dict error_kinds() {
  py::dict kinds;
#define P2P_ERROR_KIND_ENTRY(kind, value, exception) \
  if (value != 0) kinds[py::int_(value)] = exception;
  P2P_ERROR_KINDS(P2P_ERROR_KIND_ENTRY)
#undef P2P_ERROR_KIND_ENTRY
  return kinds;
}

// The constructor's arguments (None: not given), then the environment, then the defaults; the
// provider's defaults follow in Setup, once the provider is known.
Config make_config(const py::dict& d) {
  Config c;
  std::set<std::string> given;
  auto get = [&](const char* key, auto& field) {
    if (!d.contains(key) || d[key].is_none()) return;
    field = d[key].cast<std::remove_reference_t<decltype(field)>>();
    given.insert(key);
  };
#define P2P_SETTING_ARGUMENT(key, field, type, value, env) get(#key, c.field);
  P2P_SETTINGS(P2P_SETTING_ARGUMENT)
#undef P2P_SETTING_ARGUMENT
  get("cuda_device", c.cuda_device);
  get("port", c.port);
  std::string path = "auto";
  get("data_path", path);
  if (path == "direct") c.data_path = DataPath::Direct;
  else if (path == "staged") c.data_path = DataPath::Staged;
  else if (path != "auto") throw Error(ErrorKind::Value, "data_path must be None, 'direct' or 'staged', not '" + path + "'");
  c.chosen = given;
  read_environment(c, given);
  return c;
}

// An operation completes the torch future made for it in Python: the engine gets the future
// before the operation starts (so that it can complete it without the GIL: TorchFutures) and
// gives it back if the operation does not start.
template <typename Start>
void start(Engine& e, uint64_t id, const py::object& future, Start&& operation) {
  e.expect(id, future.cast<std::shared_ptr<torch::jit::PythonFutureWrapper>>()->fut);
  try {
    operation();
  } catch (...) {
    e.forget(id);
    throw;
  }
}

py::object setting(const Config& c, const std::string& name) {
#define P2P_SETTING_VALUE(key, field, type, value, env) \
  if (name == #key) return py::cast(c.field);
  P2P_SETTINGS(P2P_SETTING_VALUE)
#undef P2P_SETTING_VALUE
  throw Error(ErrorKind::Value, "no setting " + name);
}

py::list nic_list(const fabric::Offer& offer) {
  py::list nics;
  for (const auto& n : offer.nics()) {
    py::dict d;
    d["domain"] = n.domain;
    d["fabric"] = n.fabric;
    d["pci"] = n.pci.empty() ? py::object(py::none()) : py::object(py::str(n.pci));
    d["speed_bps"] = n.speed_bps ? py::object(py::int_(n.speed_bps)) : py::object(py::none());
    nics.append(d);
  }
  return nics;
}

py::tuple completion_tuple(Completion& c) {
  py::object payload = py::none(), address = py::none();
  if (!c.address.empty()) {
    payload = py::bytes(c.payload);
    address = py::bytes(c.address);
  }
  return py::make_tuple(c.id, static_cast<int>(c.status.kind), text(c.status.message), payload, address);
}

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
                               size_t pending, bool needs_fence) {
  Transfer t;
  t.state = state_named(state);
  t.kind = message ? TransferKind::Message : TransferKind::Write;
  if (!ok) t.status = Status::error(ErrorKind::Peer, "failed");
  t.held = held;
  t.acked = acked;
  t.pending = pending;
  return name(t.next_step(needs_fence));
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
void bind_parts(py::module_& m) {
  // The striper (tests/test_striper.py).
  m.def("_stripe", &stripe);
  m.def("_stripe_slots", &stripe_slots);
  m.def("_slot_size", &slot_size);
  // The transfer state machine (csrc/engine/transfer.h; tests/test_transfer_state.py).
  m.def("_transfer_next_step", &transfer_next_step, py::arg("state"), py::arg("message"), py::arg("ok"),
        py::arg("held"), py::arg("acked"), py::arg("pending"), py::arg("needs_fence"));
  m.def("_transfer_may_enter", &transfer_may_enter);

  // One peer's liveness schedule (csrc/engine/liveness.h) on a clock the caller
  // passes, for tests/test_liveness.py.
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

// The wire records (csrc/engine/address.h, remote_view.h) as dicts, for tests and tools that
// forge handles: decode validates as the engine does; encode writes any field values, valid
// or not (it checks nothing), with every CRC right.
py::dict address_fields(const EngineAddress& a) {
  py::dict d;
  d["provider"] = py::bytes(a.provider);
  d["incarnation"] = a.incarnation;
  py::list rails;
  for (const auto& r : a.rails) rails.append(py::bytes(r));
  d["rails"] = rails;
  d["host"] = py::bytes(a.host);
  d["pid"] = a.pid;
  d["cuda_ipc"] = a.cuda_ipc;
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
  a.cuda_ipc = field<bool>(d, "cuda_ipc");
  return py::bytes(a.encode());
}

py::dict remote_fields(const RemoteView& v) {
  const RemoteRegion& g = *v.region;
  py::dict region;
  region["owner"] = py::bytes(g.owner);
  region["id"] = g.id;
  region["nbytes"] = g.nbytes;
  region["access"] = g.access;
  region["staged"] = g.staged;
  region["device_type"] = g.device_type;
  region["device_index"] = g.device_index;
  region["piece_bytes"] = g.piece_bytes;
  region["rails"] = g.rails;
  py::list entries;
  for (size_t i = 0; i < g.base.size(); ++i) entries.append(py::make_tuple(g.base[i], g.key[i]));
  region["entries"] = entries;
  region["ipc_handle"] = py::bytes(g.ipc.handle);
  region["ipc_offset"] = g.ipc.offset;
  region["ipc_ptr"] = g.ipc.ptr;
  py::dict d;
  d["region"] = region;
  d["dtype"] = static_cast<int>(v.dtype);
  d["shape"] = v.shape;
  d["strides"] = v.strides;
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
  g->staged = field<bool>(r, "staged");
  g->device_type = field<int8_t>(r, "device_type");
  g->device_index = field<int16_t>(r, "device_index", -1);
  g->piece_bytes = field<uint64_t>(r, "piece_bytes");
  g->rails = field<uint16_t>(r, "rails");
  for (const auto& [base, key] : field<std::vector<std::pair<uint64_t, uint64_t>>>(r, "entries")) {
    g->base.push_back(base);
    g->key.push_back(key);
  }
  g->ipc.handle = field<std::string>(r, "ipc_handle");
  g->ipc.offset = field<uint64_t>(r, "ipc_offset");
  g->ipc.ptr = field<uint64_t>(r, "ipc_ptr");
  RemoteView v;
  v.region = g;
  v.dtype = static_cast<c10::ScalarType>(field<int8_t>(d, "dtype"));
  v.shape = field<std::vector<int64_t>>(d, "shape");
  v.strides = field<std::vector<int64_t>>(d, "strides");
  v.offset = field<int64_t>(d, "offset");
  return py::bytes(v.encode());
}

// Private bindings of the wire records, for tests and tools (tests/peer_helpers.py).
void bind_wire(py::module_& m) {
  m.def("_decode_address", [](const py::bytes& b) { return address_fields(EngineAddress::decode(std::string(b))); });
  m.def("_encode_address", &encode_address);
  m.def("_decode_remote", [](const py::bytes& b) { return remote_fields(*RemoteView::decode(std::string(b))); });
  m.def("_encode_remote", &encode_remote);
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

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "torch_p2p native engine (see torch_p2p/__init__.py)";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      raise(e);
    }
  });

#ifdef WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif

  m.attr("error_kinds") = error_kinds();
  set_log_level(log_level_from_environment());

  m.def("libfabric_version", [] {
    const uint32_t v = fi_version();
    return py::make_tuple(FI_MAJOR(v), FI_MINOR(v));
  }, "(major, minor) of the libfabric loaded at run time.");

  m.def("list_nics", [](const std::string& provider, bool want_hmem) {
    Config c;
    read_environment(c, {"provider"});
    fabric::Offer offer = fabric::query(provider, want_hmem, c.query_options());
    return py::make_tuple(offer.provider, offer.hmem, nic_list(offer));
  }, py::arg("provider"), py::arg("want_hmem"),
     "Resolves a provider name and lists its NICs: (provider, hmem, [nic dicts]).");

  m.def("settings", [] {
    py::list rows;
    for (const SettingInfo& r : setting_table()) rows.append(py::make_tuple(r.key, r.variable, r.default_text));
    return rows;
  }, "The settings table (csrc/engine/config.h): [(key, TORCH_P2P_* variable or '', default as text)].");

  py::class_<Setup>(m, "Setup")
      .def(py::init([](const py::dict& args) {
        Config c = make_config(args);
        py::gil_scoped_release release;  // the provider query may take a while
        return Setup(std::move(c));
      }), "Resolves the settings (arguments, environment, provider defaults) and queries the provider.")
      .def_property_readonly("provider", [](const Setup& s) { return s.offer->provider; })
      .def_property_readonly("hmem", [](const Setup& s) { return s.offer->hmem; })
      .def_property_readonly("nics", [](const Setup& s) { return nic_list(*s.offer); })
      .def("setting", [](const Setup& s, const std::string& key) { return setting(s.config, key); })
      .def("place", &Setup::place, py::arg("domains"), py::arg("cpu"), py::arg("node_cpus"));

  bind_parts(m);

  py::class_<RemoteView, std::shared_ptr<RemoteView>>(m, "RemoteView")
      .def_property_readonly("dtype", [](const RemoteView& v) { return v.dtype; })
      .def_property_readonly("shape", [](const RemoteView& v) { return v.shape; })
      .def_property_readonly("strides", [](const RemoteView& v) { return v.strides; })
      .def_property_readonly("offset", [](const RemoteView& v) { return v.offset; })
      .def_property_readonly("element_size", &RemoteView::elem)
      .def_property_readonly("owner", [](const RemoteView& v) { return py::bytes(v.region->owner); })
      .def_property_readonly("region_id", [](const RemoteView& v) { return v.region->id; })
      .def_property_readonly("nbytes", [](const RemoteView& v) { return v.region->nbytes; })
      .def_property_readonly("access", [](const RemoteView& v) { return v.region->access; })
      .def_property_readonly("staged", [](const RemoteView& v) { return v.region->staged; })
      .def_property_readonly("device", [](const RemoteView& v) {
        return v.region->device_type == 1 ? "cuda:" + std::to_string(v.region->device_index) : std::string("cpu");
      })
      .def_property_readonly("keys", [](const RemoteView& v) { return v.region->key; })
      .def_property_readonly("rails", [](const RemoteView& v) { return v.region->rails; })
      .def("view", &RemoteView::view)
      .def("to_bytes", [](const RemoteView& v) { return py::bytes(v.encode()); })
      .def_static("from_bytes", [](const py::bytes& b) { return RemoteView::decode(std::string(b)); });

  py::class_<Engine>(m, "Engine")
      .def(py::init([](const Setup& setup) {
        Setup copy = setup;
        py::gil_scoped_release release;  // the worker opens its rails meanwhile
        return std::make_unique<Engine>(std::move(copy));
      }))
      .def_property_readonly("address", [](const Engine& e) { return py::bytes(e.address()); })
      .def_property_readonly("provider", &Engine::provider)
      .def_property_readonly("data_path", &Engine::data_path)
      .def_property_readonly("delivery_complete", &Engine::delivery_complete)
      .def_property_readonly("auto_progress", &Engine::auto_progress)
      .def_property_readonly("closed", &Engine::closed)
      .def_property_readonly("rails", [](const Engine& e) {
        py::list out;
        for (const auto& r : e.rails()) {
          py::dict d;
          d["domain"] = r.domain;
          d["fabric"] = r.fabric;
          d["tx_depth"] = r.tx_depth;
          d["wait_fd"] = r.wait_fd;
          out.append(d);
        }
        return out;
      })
      .def("register", [](Engine& e, const at::Tensor& t, const std::string& access, double timeout) {
        py::gil_scoped_release release;
        return e.register_tensor(t, access, timeout);
      })
      .def("deregister", &Engine::deregister, py::call_guard<py::gil_scoped_release>())
      .def("submit", [](Engine& e, uint64_t id, const py::object& future, bool write, const std::vector<at::Tensor>& local,
                        const std::vector<std::shared_ptr<RemoteView>>& remote, const std::vector<Engine::Pages>& local_pages,
                        const std::vector<Engine::Pages>& remote_pages, bool mirror, int64_t notify, double timeout) {
        start(e, id, future, [&] {
          py::gil_scoped_release release;  // the dispatcher completes earlier calls meanwhile
          e.submit(id, write, local, remote, local_pages, remote_pages, mirror, notify, timeout);
        });
      })
      .def("route", [](Engine& e, const py::bytes& address, std::shared_ptr<RemoteView> view) {
        std::string a = address;
        py::gil_scoped_release release;
        return e.route(a, view);
      })
      .def("connect", [](Engine& e, uint64_t id, const py::object& future, const py::bytes& a) {
        start(e, id, future, [&] { e.connect(id, a); });
      })
      .def("disconnect", [](Engine& e, uint64_t id, const py::object& future, const py::bytes& a) {
        start(e, id, future, [&] { e.disconnect(id, a); });
      })
      .def("send", [](Engine& e, uint64_t id, const py::object& future, const py::bytes& a, const py::bytes& payload,
                      double timeout) { start(e, id, future, [&] { e.send(id, a, std::string(payload), timeout); }); })
      .def("recv", [](Engine& e, uint64_t id, const py::object& future, double timeout) {
        start(e, id, future, [&] { e.recv(id, timeout); });
      })
      .def("notification", [](Engine& e, uint64_t id, const py::object& future, uint32_t tag, double timeout) {
        start(e, id, future, [&] { e.notification(id, tag, timeout); });
      })
      .def("cancel", &Engine::cancel)
      .def("poll", [](Engine& e, int timeout_ms) {
        std::vector<Completion> batch;
        {
          py::gil_scoped_release release;
          batch = e.poll(timeout_ms);
        }
        py::list out;
        for (auto& c : batch) out.append(completion_tuple(c));
        return out;
      })
      .def("drained", &Engine::drained)
      .def("close", &Engine::close, py::call_guard<py::gil_scoped_release>())
      .def("stream_wait", [](Engine& e, uint64_t stream) { return e.stream_wait(reinterpret_cast<void*>(stream)); },
           py::call_guard<py::gil_scoped_release>())
      .def("stream_release", &Engine::stream_release);

  bind_wire(m);
}
