#include "bindings/futures.h"

#include <torch/csrc/jit/python/pybind_utils.h>  // PythonFutureWrapper: torch.futures.Future

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "bindings/objects.h"
#include "common/error.h"

namespace p2p::bindings {

namespace {

using Wrapper = torch::jit::PythonFutureWrapper;
using WrapperHolder = std::shared_ptr<Wrapper>;

const py::detail::type_info* future_type = nullptr;  // null: __init__ sets futures up
bool futures_checked = false;

TorchFuture init_in_place(py::handle obj, const py::detail::type_info* info) {
  P2P_CHECK(PyObject_TypeCheck(obj.ptr(), info->type), ErrorKind::Value, "not a torch future: ", Py_TYPE(obj.ptr())->tp_name);
  py::detail::value_and_holder v_h = reinterpret_cast<py::detail::instance*>(obj.ptr())->get_value_and_holder(info);
  P2P_CHECK(!v_h.holder_constructed(), ErrorKind::Value, "the future is in use already");
  auto fut = c10::make_intrusive<c10::ivalue::Future>(c10::PyObjectType::get());
  auto holder = std::make_shared<Wrapper>(fut);
  v_h.value_ptr() = holder.get();
  v_h.type->init_instance(v_h.inst, &holder);
  return fut;
}

TorchFuture init_by_constructor(py::handle obj) {
  static PyObject* const future_class = py::object(py::module_::import("torch").attr("_C").attr("Future")).release().ptr();
  P2P_CHECK(PyObject_TypeCheck(obj.ptr(), reinterpret_cast<PyTypeObject*>(future_class)), ErrorKind::Value,
            "not a torch future: ", Py_TYPE(obj.ptr())->tp_name);
  py::handle(future_class).attr("__init__")(obj, py::list());
  return torch_future(py::reinterpret_borrow<py::object>(obj));
}

// PythonFutureWrapper's type record, if its holder is a shared_ptr (by the record's sizes) and a
// probe future set up in place reads back through torch's own methods and pybind11's caster.
const py::detail::type_info* checked_future_type() {
  const py::detail::type_info* info = py::detail::get_type_info(typeid(Wrapper));
  if (!shared_ptr_holder(info, sizeof(WrapperHolder)) || info->type_size != sizeof(Wrapper)) return nullptr;
  try {
    py::handle type(reinterpret_cast<PyObject*>(info->type));
    py::object probe = type.attr("__new__")(type);
    const TorchFuture fut = init_in_place(probe, info);
    if (probe.attr("done")().cast<bool>()) return nullptr;
    fut->markCompleted(c10::IValue());
    const bool same = probe.attr("done")().cast<bool>() && probe.attr("value")().is_none() &&
                      probe.cast<WrapperHolder>()->fut.get() == fut.get();
    return same ? info : nullptr;
  } catch (const std::exception&) {  // py::error_already_set, pybind11's cast_error, p2p::Error
    return nullptr;
  }
}

}  // namespace

void init_futures() {
  if (futures_checked) return;
  future_type = checked_future_type();
  futures_checked = true;
}

bool futures_init_in_place() { return future_type != nullptr; }

void disable_futures_in_place() {
  futures_checked = true;
  future_type = nullptr;
}

TorchFuture init_future(py::handle obj) {
  init_futures();
  return future_type ? init_in_place(obj, future_type) : init_by_constructor(obj);
}

TorchFuture torch_future(const py::object& future) { return future.cast<WrapperHolder>()->fut; }

// Spins first (a small call's completion comes within spin_us on a pinned engine), then waits
// on a condition variable that a callback of the future's own sets, from whichever thread
// completes it: no thread takes the GIL to tell the waiter, as a Python callback setting a
// threading.Event would. Unlike Future.wait(), a timeout and Ctrl-C end it. A wait that ends
// first leaves its callback (a few bytes) on the future until the future completes: torch has
// no way to take one back.
bool wait_done(const py::object& future, int spin_us, double timeout_s) {
  struct Waiter {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
  };
  const TorchFuture fut = torch_future(future);
  if (fut->completed()) return true;
  py::gil_scoped_release release;
  engine::spin_until([&] { return fut->completed(); }, spin_us);
  if (fut->completed() || timeout_s <= 0) return fut->completed();
  auto waiter = std::make_shared<Waiter>();
  fut->addCallback([waiter](c10::ivalue::Future&) {
    std::lock_guard<std::mutex> lock(waiter->mu);
    waiter->done = true;
    waiter->cv.notify_all();
  });
  using Clock = std::chrono::steady_clock;
  const auto deadline = timeout_s < 1e9  // inf, or any time past a process's life: no deadline
      ? Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s))
      : Clock::time_point::max();
  while (true) {
    {
      std::unique_lock<std::mutex> lock(waiter->mu);
      if (waiter->cv.wait_until(lock, std::min(deadline, Clock::now() + std::chrono::milliseconds(50)),
                                [&] { return waiter->done; }))
        return true;
    }
    if (Clock::now() >= deadline) return false;
    py::gil_scoped_acquire gil;  // not under waiter->mu: a thread holding the GIL may complete the future
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  }
}

}  // namespace p2p::bindings
