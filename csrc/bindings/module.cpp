// torch_p2p._C: the module's definition. Each part binds itself (bindings.h); here p2p::Error
// becomes the Python exception its kind names, and torch_p2p.engine hands over its classes.
#include "bindings/bindings.h"
#include "bindings/futures.h"
#include "bindings/objects.h"
#include "common/error.h"
#include "common/log.h"
#include "core/config.h"

namespace py = pybind11;

namespace p2p::bindings {
namespace {

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

}  // namespace
}  // namespace p2p::bindings

PYBIND11_MODULE(_C, m) {
  namespace b = p2p::bindings;
  m.doc() = "torch_p2p native engine (see torch_p2p/__init__.py)";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const p2p::Error& e) {
      b::raise(e);
    }
  });
#ifdef WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  m.attr("error_kinds") = b::error_kinds();
  p2p::set_log_level(p2p::core::log_level_from_environment());

  b::bind_facts(m);
  b::bind_engine(m);
  b::bind_remote(m);
  b::bind_pages(m);
  m.def("_wait_done", &b::wait_done, py::arg("future"), py::arg("spin_us"), py::arg("timeout_s"),
        "Whether `future` completed within timeout_s (inf: no limit), first spinning up to spin_us; "
        "the GIL released, Python's signal handlers run every 50 ms.");
  m.def("_set_classes", &b::set_classes, py::arg("pages"), py::arg("remote_tensor"), py::arg("sequence"),
        "torch_p2p.engine's Pages, RemoteTensor and collections.abc.Sequence, for write_slices' arguments; "
        "checks the in-place reads of them (_fast_paths).");
  m.def("_fast_paths", &b::fast_paths,
        "Which in-place reads of Python objects are on ({name: bool}); one that is off takes pybind11's path.");
  m.def("_disable_fast_paths", &b::disable_fast_paths, "Turns every in-place read off, for tests of the safe paths.");
  b::bind_parts(m);
  b::bind_wire(m);
}
