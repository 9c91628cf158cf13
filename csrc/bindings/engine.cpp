// engine::Engine as torch_p2p._C.Engine, with Setup (the settings resolved, the provider
// queried) and Prepared. An operation's binding makes no future: it sets up the one
// torch_p2p.engine made for it (futures.h) and starts the operation, whose completion the
// dispatcher polls (poll) or the engine's table completes without the GIL.
#include <optional>

#include "bindings/bindings.h"
#include "bindings/call_args.h"
#include "bindings/facts.h"
#include "bindings/futures.h"
#include "bindings/objects.h"
#include "core/config.h"
#include "engine/engine.h"

namespace p2p::bindings {

using core::Config;
using core::DataPath;
using core::Setup;
using engine::Completion;
using engine::Engine;
using engine::TorchFutures;

namespace {

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
  core::read_environment(c, given);
  return c;
}

py::object setting(const Config& c, const std::string& name) {
#define P2P_SETTING_VALUE(key, field, type, value, env) \
  if (name == #key) return py::cast(c.field);
  P2P_SETTINGS(P2P_SETTING_VALUE)
#undef P2P_SETTING_VALUE
  throw Error(ErrorKind::Value, "no setting " + name);
}

// (future, error kind, message, payload, sender address) for the dispatcher.
py::tuple completion_tuple(Completion& c, py::object future) {
  py::object payload = py::none(), address = py::none();
  if (!c.address.empty()) {
    payload = py::bytes(c.payload);
    address = py::bytes(c.address);
  }
  return py::make_tuple(std::move(future), static_cast<int>(c.status.kind), text(c.status.message), payload, address);
}

// A host call keeps the GIL: it may be copied by the caller (core/caller_copies.h), and in a
// process whose other threads keep the GIL busy (vLLM's workers) each release costs a wait for
// it. A CUDA call lets it go: it asks CUDA about the caller's stream.
struct CallGil {
  std::optional<py::gil_scoped_release> release;
  explicit CallGil(bool cuda) {
    if (cuda) release.emplace();
  }
};

void submit(Engine& e, const py::object& future, bool write, py::handle local, py::handle remote, py::handle notify,
            py::handle timeout) {
  start(e, future, [&](uint64_t id) {
    with_call_args(local, remote, notify, timeout, [&](const CallArgs& a) {
      const CallGil gil(std::any_of(a.local.begin(), a.local.end(), [](const at::Tensor& t) { return t.is_cuda(); }));
      e.submit(id, write, a.local, a.remote, a.local_pages, a.remote_pages, a.mirror, a.notify, a.timeout);
    });
  });
}

std::shared_ptr<Engine::Prepared> prepare(Engine& e, bool write, py::handle local, py::handle remote, py::handle notify,
                                          py::handle timeout) {
  return with_call_args(local, remote, notify, timeout, [&](const CallArgs& a) {
    py::gil_scoped_release release;
    return e.prepare(write, a.local, a.remote, a.local_pages, a.remote_pages, a.mirror, a.notify, a.timeout);
  });
}

void run_pages(Engine& e, const py::object& future, const std::shared_ptr<Engine::Prepared>& call, py::handle lids,
               py::handle rids, py::handle notify) {
  const int64_t tag = notify_arg(notify);
  const at::Tensor& l = page_ids(lids);
  const at::Tensor& r = page_ids(rids);
  start(e, future, [&](uint64_t id) {
    const CallGil gil(call->cuda);
    e.run_pages(id, *call, l, r, tag);
  });
}

py::list poll(Engine& e, int timeout_ms) {
  std::vector<Engine::ForPython> batch;
  std::vector<TorchFutures::Handle> released;
  {
    py::gil_scoped_release release;
    e.poll(timeout_ms, batch, released);
  }
  for (TorchFutures::Handle h : released) py::handle(static_cast<PyObject*>(h)).dec_ref();
  py::list out;
  for (auto& [c, h] : batch) out.append(completion_tuple(c, py::reinterpret_steal<py::object>(static_cast<PyObject*>(h))));
  return out;
}

}  // namespace

void bind_engine(py::module_& m) {
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

  py::class_<Engine::Prepared, std::shared_ptr<Engine::Prepared>>(m, "Prepared")  // Engine.run takes it
      .def_property_readonly("takes_pages", [](const Engine::Prepared& p) { return p.lcount >= 0; });

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
      .def_property_readonly("rails", [](const Engine& e) { return rail_list(e.rails()); })
      .def("register", [](Engine& e, const at::Tensor& t, const std::string& access, double timeout) {
        py::gil_scoped_release release;
        return e.register_tensor(t, access, timeout);
      })
      .def("deregister", &Engine::deregister, py::call_guard<py::gil_scoped_release>())
      // write_slices (write) / read_slices with the user's arguments as they came (call_args.h).
      .def("submit", &submit)
      .def("prepare", &prepare)
      .def("run", [](Engine& e, const py::object& future, const std::shared_ptr<Engine::Prepared>& call) {
        start(e, future, [&](uint64_t id) {
          const CallGil gil(call->cuda);
          e.run(id, *call);
        });
      })
      .def("run_pages", &run_pages)
      .def("route", [](Engine& e, const py::bytes& address, std::shared_ptr<engine::RemoteView> view) {
        std::string a = address;
        py::gil_scoped_release release;
        return e.route(a, view);
      })
      .def("connect", [](Engine& e, const py::object& future, const py::bytes& a) {
        start(e, future, [&](uint64_t id) { e.connect(id, a); });
      })
      .def("disconnect", [](Engine& e, const py::object& future, const py::bytes& a) {
        start(e, future, [&](uint64_t id) { e.disconnect(id, a); });
      })
      .def("send", [](Engine& e, const py::object& future, const py::bytes& a, const py::bytes& payload, py::handle timeout) {
        const double t = timeout_arg(timeout);
        start(e, future, [&](uint64_t id) { e.send(id, a, std::string(payload), t); });
      })
      .def("recv", [](Engine& e, const py::object& future, py::handle timeout) {
        const double t = timeout_arg(timeout);
        start(e, future, [&](uint64_t id) { e.recv(id, t); });
      })
      .def("notification", [](Engine& e, const py::object& future, py::handle tag, py::handle timeout) {
        const uint32_t value = tag_arg(tag, "tag");
        const double t = timeout_arg(timeout);
        start(e, future, [&](uint64_t id) { e.notification(id, value, t); });
      })
      .def("cancel", [](Engine& e, const py::object& future) { e.cancel(torch_future(future)); })
      .def("poll", &poll)
      .def("take_futures", [](Engine& e) {
        py::list out;
        for (TorchFutures::Handle h : e.take_futures()) out.append(py::reinterpret_steal<py::object>(static_cast<PyObject*>(h)));
        return out;
      })
      .def_property_readonly("futures_held", &Engine::futures_held)
      .def_property_readonly("completion_spin_us", &Engine::completion_spin_us)
      .def("drained", &Engine::drained)
      .def("close", &Engine::close, py::call_guard<py::gil_scoped_release>())
      .def("stream_wait", [](Engine& e, uint64_t stream, const py::object& future) {
        const TorchFuture fut = torch_future(future);
        py::gil_scoped_release release;
        e.stream_wait(reinterpret_cast<void*>(stream), fut);
      });
}

}  // namespace p2p::bindings
