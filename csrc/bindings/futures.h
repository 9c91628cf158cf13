// The torch futures that operations complete: set up here for a Python object that
// torch_p2p.engine made with torch._C.Future.__new__ and no __init__, handed to the engine's
// table (engine/futures.h) when the operation starts, and waited for without the GIL.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include "engine/engine.h"

namespace p2p::bindings {

namespace py = pybind11;
using TorchFuture = c10::intrusive_ptr<c10::ivalue::Future>;

// Decides once whether init_future sets futures up in place (below); set_classes calls it.
void init_futures();
bool futures_init_in_place();
void disable_futures_in_place();  // for tests of the safe path

// The torch future of `obj`, set up as torch._C.Future.__init__([]) would (a future of Python
// objects on no device). NOTE: in place (pybind11's factory-constructor steps, without
// __init__'s argument conversion and dispatch) it costs a third of a future made by __init__,
// about 1 us less a call. That relies on torch binding PythonFutureWrapper with a shared_ptr
// holder, which init_futures checks on a probe future (torch's own methods read it back);
// where the check fails, __init__ does it.
TorchFuture init_future(py::handle obj);

// The torch future of a torch.futures.Future, through pybind11's caster.
TorchFuture torch_future(const py::object& future);

// Starts an operation that completes `future`: the engine's table takes the future (so that it
// can complete it without the GIL: TorchFutures) and a reference to its Python object before
// the operation starts, names the operation's id, and gives both back if it does not start.
template <typename Start>
void start(engine::Engine& e, const py::object& future, Start&& operation) {
  const uint64_t id = e.expect(init_future(future), future.inc_ref().ptr());
  try {
    operation(id);
  } catch (...) {
    py::handle(static_cast<PyObject*>(e.forget(id))).dec_ref();
    throw;
  }
}

// Whether `future` completed within timeout_s (inf: no limit), first spinning up to spin_us;
// the GIL released, Python's signal handlers run every 50 ms.
bool wait_done(const py::object& future, int spin_us, double timeout_s);

}  // namespace p2p::bindings
