// Wraps engine::Engine and engine::RemoteView as torch_p2p._C, and turns p2p::Error into the
// Python exception its kind names (with bindings_internal.cpp, the only files that know pybind11).
// torch's pieces this file uses, not <torch/extension.h> (the whole C++ frontend: nn, optim,
// data), which a 2-core build pays for in every file that includes it.
#include <torch/csrc/autograd/python_variable.h>  // THPVariable_Check, THPVariable_Unpack
#include <torch/csrc/jit/python/pybind_utils.h>   // PythonFutureWrapper: torch.futures.Future
#include <torch/csrc/utils/pybind.h>               // pybind11 with torch's casters (at::Tensor, IntArrayRef)
#include <structmember.h>  // PyMemberDef, T_OBJECT_EX

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>

#include "bindings_internal.h"
#include "common/error.h"
#include "common/wire.h"
#include "core/config.h"
#include "core/runs.h"
#include "core/striper.h"
#include "engine/engine.h"
#include "fabric/info.h"
#include "fabric/profile.h"
#include "fabric/registration.h"

namespace py = pybind11;
using namespace p2p;
using namespace p2p::engine;
using namespace p2p::core;

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

// The torch future of a Python object that torch_p2p.engine made with torch._C.Future.__new__
// and no __init__: what torch._C.Future.__init__([]) would give it (a future of Python objects
// on no device), set as pybind11's factory constructors set it, without __init__'s argument
// conversion and dispatch (two thirds of a future's cost, about 1 us).
c10::intrusive_ptr<c10::ivalue::Future> init_future(py::handle obj) {
  using Wrapper = torch::jit::PythonFutureWrapper;
  static const py::detail::type_info* const info = py::detail::get_type_info(typeid(Wrapper), true);
  P2P_CHECK(PyObject_TypeCheck(obj.ptr(), info->type), ErrorKind::Value, "not a torch future: ", Py_TYPE(obj.ptr())->tp_name);
  py::detail::value_and_holder v_h = reinterpret_cast<py::detail::instance*>(obj.ptr())->get_value_and_holder(info);
  P2P_CHECK(!v_h.holder_constructed(), ErrorKind::Value, "the future is in use already");
  auto fut = c10::make_intrusive<c10::ivalue::Future>(c10::PyObjectType::get());
  auto holder = std::make_shared<Wrapper>(fut);
  v_h.value_ptr() = holder.get();
  v_h.type->init_instance(v_h.inst, &holder);
  return fut;
}

// An operation completes the future made for it in Python (init_future): the engine's table
// takes the future (so that it can complete it without the GIL: TorchFutures) and a reference
// to its Python object before the operation starts, names the operation's id, and gives both
// back if the operation does not start.
template <typename Start>
void start(Engine& e, const py::object& future, Start&& operation) {
  const uint64_t id = e.expect(init_future(future), future.inc_ref().ptr());
  try {
    operation(id);
  } catch (...) {
    py::handle(static_cast<PyObject*>(e.forget(id))).dec_ref();
    throw;
  }
}

// write_slices / read_slices / prepare_*: their arguments taken apart here, not in Python, since
// a small paged call is bound by its cost per call (Python's unpacking and pybind11's list
// conversions took several microseconds of it). Messages and order of checks are Python's.
struct Classes {
  PyObject* pages = nullptr;          // torch_p2p.engine.Pages
  PyObject* remote_tensor = nullptr;  // torch_p2p.remote.RemoteTensor
  PyObject* sequence = nullptr;       // collections.abc.Sequence
};
Classes classes;  // set once by torch_p2p.engine (_C._set_classes); references kept for good

// isinstance() through the type's MRO only, without calling __instancecheck__ (Pages and
// RemoteTensor define none) as PyObject_IsInstance does when the type is not the exact one.
bool is_a(py::handle obj, PyObject* cls) { return PyObject_TypeCheck(obj.ptr(), reinterpret_cast<PyTypeObject*>(cls)); }

bool is_instance(py::handle obj, PyObject* cls) {
  const int r = PyObject_IsInstance(obj.ptr(), cls);
  if (r < 0) throw py::error_already_set();
  return r == 1;
}

std::string type_name(py::handle obj) { return py::type::handle_of(obj).attr("__name__").cast<std::string>(); }

// An attribute name, interned at its first use (a lookup by C string makes a Python string
// each time); kept for good.
struct Name {
  const char* text;
  PyObject* interned = nullptr;
};
Name ids_name{"ids"}, dim_name{"dim"}, base_name{"base"}, view_name{"_v"};

PyObject* interned(Name& name) {
  if (!name.interned) name.interned = PyUnicode_InternFromString(name.text);
  return name.interned;
}

py::object attribute(py::handle obj, Name& name) {
  PyObject* value = PyObject_GetAttr(obj.ptr(), interned(name));
  if (!value) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(value);
}

struct CallArgs {
  std::vector<at::Tensor> local;
  std::vector<std::shared_ptr<RemoteView>> remote;
  std::vector<Engine::Pages> local_pages, remote_pages;
  bool mirror = false;
  bool grouped = false;  // view pairs became pages (group_views)
  int64_t notify = -1;
  double timeout = 0;  // 0: the engine's default
};

// The view of a RemoteTensor (pybind11's holder of its _v), else null. Read straight from the
// slot (its member descriptor's offset) with pybind11's type record, both looked up once: by
// name and by typeid, the two lookups cost more than the rest of a view pair's parse.
struct ViewSlot {
  Py_ssize_t offset = -1;                             // of _v in a RemoteTensor; -1: not found
  const py::detail::type_info* view_type = nullptr;  // RemoteView's
};

const ViewSlot& view_slot() {
  static ViewSlot slot;
  if (slot.view_type || !classes.remote_tensor) return slot;
  PyObject* d = PyDict_GetItemString(reinterpret_cast<PyTypeObject*>(classes.remote_tensor)->tp_dict, "_v");
  if (d && Py_TYPE(d) == &PyMemberDescr_Type && reinterpret_cast<PyMemberDescrObject*>(d)->d_member->type == T_OBJECT_EX)
    slot.offset = reinterpret_cast<PyMemberDescrObject*>(d)->d_member->offset;
  slot.view_type = py::detail::get_type_info(typeid(RemoteView));
  return slot;
}

// The pybind11 instance of a RemoteView held by RemoteTensor `obj`'s slot, else null.
py::detail::instance* view_instance(PyObject* obj, const ViewSlot& slot) {
  if (slot.offset < 0) return nullptr;
  PyObject* v = *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj) + slot.offset);  // obj holds it
  return v && Py_TYPE(v) == slot.view_type->type ? reinterpret_cast<py::detail::instance*>(v) : nullptr;
}

const std::shared_ptr<RemoteView>* view_of(PyObject* obj) {
  if (!classes.remote_tensor || !PyObject_TypeCheck(obj, reinterpret_cast<PyTypeObject*>(classes.remote_tensor)))
    return nullptr;
  const ViewSlot& slot = view_slot();
  py::detail::instance* v = view_instance(obj, slot);
  return v ? &v->get_value_and_holder(slot.view_type, false).holder<std::shared_ptr<RemoteView>>() : nullptr;
}

// Waits, without the GIL, for a torch future: spinning first (a small call's completion comes
// within spin_us on a pinned engine), then on a condition variable that a callback of the
// future's own sets, from whichever thread completes it: no thread takes the GIL to tell the
// waiter, as a Python callback setting a threading.Event would. Unlike Future.wait(), a timeout
// and Ctrl-C end it. A wait that ends first leaves its callback (a few bytes) on the future
// until the future completes: torch has no way to take one back.
bool wait_done(const py::object& future, int spin_us, double timeout_s) {
  struct Waiter {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
  };
  const c10::intrusive_ptr<c10::ivalue::Future> fut =
      future.cast<std::shared_ptr<torch::jit::PythonFutureWrapper>>()->fut;
  if (fut->completed()) return true;
  py::gil_scoped_release release;
  spin_until([&] { return fut->completed(); }, spin_us);
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

// The ids of a Pages or of run_pages: a tensor (dtype and shape are checked where they are used).
const at::Tensor& page_ids(py::handle ids) {
  if (!THPVariable_Check(ids.ptr())) throw py::type_error(kPageIdForm);
  return THPVariable_Unpack(ids.ptr());
}

// Item i of one side: a tensor (local) or RemoteTensor (remote), or a Pages of one.
void add_item(size_t i, py::handle item, bool local, CallArgs& a) {
  py::object base = py::reinterpret_borrow<py::object>(item);
  Engine::Pages pages;
  if (is_a(item, classes.pages)) {
    pages = std::make_tuple(page_ids(attribute(item, ids_name)), attribute(item, dim_name).cast<int64_t>());
    base = attribute(item, base_name);
  }
  if (local ? !THPVariable_Check(base.ptr()) : !is_a(base, classes.remote_tensor))
    throw py::type_error(cat(local ? "local view " : "remote ", i, " is a ", type_name(base),
                             local ? ", not a tensor" : ", not a RemoteTensor"));
  if (local) {
    a.local.push_back(THPVariable_Unpack(base.ptr()));
    a.local_pages.push_back(std::move(pages));
  } else {
    const std::shared_ptr<RemoteView>* view = view_of(base.ptr());
    a.remote.push_back(view ? *view : attribute(base, view_name).cast<std::shared_ptr<RemoteView>>());
    a.remote_pages.push_back(std::move(pages));
  }
}

// One side: a tensor (local) or RemoteTensor (remote), a Pages of one, or a sequence of them.
void unpack(py::handle views, bool local, CallArgs& a) {
  PyObject* v = views.ptr();
  if (THPVariable_Check(v) || is_a(views, classes.remote_tensor) || is_a(views, classes.pages))
    return add_item(0, views, local, a);
  if (PyList_Check(v) || PyTuple_Check(v)) {
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(v); ++i)
      add_item(i, PySequence_Fast_GET_ITEM(v, i), local, a);
    return;
  }
  if (is_instance(views, classes.sequence)) {
    const py::sequence items = py::reinterpret_borrow<py::sequence>(views);
    const size_t n = items.size();
    for (size_t i = 0; i < n; ++i) add_item(i, items[i], local, a);
    return;
  }
  throw py::type_error(cat("the ", local ? "local views" : "remote tensors", " must be a tensor or a sequence of them, not ",
                           type_name(views)));
}

// A list of view pairs as users write it first ([cache[i] for i in mine], [remote[j] for j in
// theirs]) costs what p2p.pages does: consecutive pairs whose local views share a storage,
// shape, strides and dtype and whose remote views share a region, shape, strides and dtype
// become one pages entry on each side (page ids and a page stride: page_grid), read straight
// from the tensors and RemoteViews, without a Python object per field. Other pairs stay views.
// The grouped call moves the same bytes in the same order; a grouped call that build() refuses
// is parsed again view by view (with_call_args), which moves it or names the view at fault as
// before (pages refuse a destination page named twice, where views of one place are allowed).

// The TensorImpl of a plain tensor that can be a page (strided, not empty), else null.
const at::TensorImpl* groupable_tensor(PyObject* obj) {
  if (!THPVariable_CheckExact(obj)) return nullptr;
  const at::TensorImpl* t = THPVariable_Unpack(obj).unsafeGetTensorImpl();
  const bool plain = t->layout() == at::kStrided && (t->is_cpu() || t->is_cuda()) && t->has_storage() &&
                     !t->is_python_dispatch() && t->numel() > 0;
  return plain ? t : nullptr;
}

// The RemoteView of an exact RemoteTensor, read from pybind11's simple layout (its value
// pointer first), which is what RemoteView instances have; else null.
const RemoteView* groupable_remote(PyObject* obj, const ViewSlot& slot) {
  if (Py_TYPE(obj) != reinterpret_cast<PyTypeObject*>(classes.remote_tensor)) return nullptr;
  const py::detail::instance* v = view_instance(obj, slot);
  return v && v->simple_layout && v->simple_holder_constructed ? static_cast<const RemoteView*>(v->simple_value_holder[0]) : nullptr;
}

// Element by element: a few dimensions, where a call of memcmp took a sixth of a pair's parse.
bool same_dims(c10::IntArrayRef a, c10::IntArrayRef b) {
  if (a.size() != b.size()) return false;
  for (size_t d = 0; d < a.size(); ++d)
    if (a[d] != b[d]) return false;
  return true;
}

// A plain tensor (THPVariable_CheckExact) of the storage, dispatch keys, dtype, sizes and
// strides of page l0, a groupable_tensor: strided, not empty and on l0's device like it. The
// storage is read unchecked: l0 has one, so a tensor without one differs.
const at::TensorImpl* same_page(PyObject* obj, const at::TensorImpl* l0) {
  if (!THPVariable_CheckExact(obj)) return nullptr;
  const at::TensorImpl* t = THPVariable_Unpack(obj).unsafeGetTensorImpl();
  const bool same = t->key_set() == l0->key_set() && t->dtype() == l0->dtype() &&
                    t->unsafe_storage().unsafeGetStorageImpl() == l0->unsafe_storage().unsafeGetStorageImpl() &&
                    same_dims(t->sizes(), l0->sizes()) && same_dims(t->strides(), l0->strides());
  return same ? t : nullptr;
}

bool same_page(const RemoteView* a, const RemoteView* b) {
  return a->region == b->region && a->dtype == b->dtype && same_dims(a->shape, b->shape) &&
         same_dims(a->strides, b->strides);
}

// Pairs k in [0, n) as one pages entry of each side: the first local view restrided into a
// tensor whose dimension 0 steps over the pages, and likewise the first remote view.
void add_group(const at::TensorImpl* l0, const RemoteView& r0, const int64_t* loffsets, const int64_t* roffsets,
               int64_t n, CallArgs& a) {
  at::Tensor lids = at::empty({n}, at::kLong), rids = at::empty({n}, at::kLong);
  const PageGrid lg = page_grid(loffsets, n, lids.data_ptr<int64_t>());
  const PageGrid rg = page_grid(roffsets, n, rids.data_ptr<int64_t>());
  std::vector<int64_t> sizes{lg.count}, strides{lg.stride};
  sizes.insert(sizes.end(), l0->sizes().begin(), l0->sizes().end());
  strides.insert(strides.end(), l0->strides().begin(), l0->strides().end());
  // A new TensorImpl on the views' storage, as as_strided makes it, without the dispatcher.
  at::Tensor base = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(l0->storage()), l0->key_set(), l0->dtype());
  base.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides, lg.origin);
  auto rv = std::make_shared<RemoteView>();
  rv->region = r0.region;
  rv->dtype = r0.dtype;
  rv->offset = rg.origin;
  rv->shape.reserve(r0.shape.size() + 1);
  rv->strides.reserve(r0.shape.size() + 1);
  rv->shape.push_back(rg.count);
  rv->strides.push_back(rg.stride);
  rv->shape.insert(rv->shape.end(), r0.shape.begin(), r0.shape.end());
  rv->strides.insert(rv->strides.end(), r0.strides.begin(), r0.strides.end());
  rv->validate();
  a.local.push_back(std::move(base));
  a.local_pages.emplace_back(std::make_tuple(std::move(lids), int64_t{0}));
  a.remote.push_back(std::move(rv));
  a.remote_pages.emplace_back(std::make_tuple(std::move(rids), int64_t{0}));
  a.grouped = true;
}

// Both sides lists (or tuples) of one length: groups them (above); false for other shapes.
bool group_views(py::handle local, py::handle remote, CallArgs& a) {
  PyObject *l = local.ptr(), *r = remote.ptr();
  if (!(PyList_Check(l) || PyTuple_Check(l)) || !(PyList_Check(r) || PyTuple_Check(r))) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(l);
  if (n < 2 || PySequence_Fast_GET_SIZE(r) != n) return false;
  PyObject** litems = PySequence_Fast_ITEMS(l);
  PyObject** ritems = PySequence_Fast_ITEMS(r);
  // Kept between calls: a fresh pair of buffers of a few KiB each per call made the allocator
  // consolidate its free lists every time.
  thread_local std::vector<int64_t> loffsets, roffsets;
  loffsets.reserve(n);
  roffsets.reserve(n);
  const ViewSlot& slot = view_slot();
  Py_ssize_t i = 0;
  while (i < n) {
    const at::TensorImpl* l0 = groupable_tensor(litems[i]);
    const RemoteView* r0 = l0 ? groupable_remote(ritems[i], slot) : nullptr;
    Py_ssize_t j = i + 1;
    if (r0) {
      loffsets.assign(1, l0->storage_offset());
      roffsets.assign(1, r0->offset);
      for (; j < n; ++j) {
        const at::TensorImpl* lj = same_page(litems[j], l0);
        if (!lj) break;
        const RemoteView* rj = groupable_remote(ritems[j], slot);
        if (!rj || !same_page(rj, r0)) break;
        loffsets.push_back(lj->storage_offset());
        roffsets.push_back(rj->offset);
      }
    }
    if (j - i >= 2) {
      add_group(l0, *r0, loffsets.data(), roffsets.data(), j - i, a);
    } else {
      add_item(i, litems[i], true, a);
      add_item(i, ritems[i], false, a);
    }
    i = std::max(j, i + 1);
  }
  return true;
}

// A call's notify argument: None (-1) or a 32-bit tag.
int64_t notify_tag(py::handle notify) {
  if (notify.is_none()) return -1;
  const py::int_ tag(py::reinterpret_borrow<py::object>(notify));
  int overflow = 0;
  const long long value = PyLong_AsLongLongAndOverflow(tag.ptr(), &overflow);
  if (overflow || value < 0 || value >= (1LL << 32))
    throw py::value_error(cat("notify must be a 32-bit unsigned tag, not ", py::str(notify).cast<std::string>()));
  return value;
}

CallArgs call_args(py::handle local, py::handle remote, py::handle notify, py::handle timeout, bool group) {
  P2P_CHECK(classes.pages, ErrorKind::Generic, "torch_p2p.engine did not set up its classes");
  CallArgs a;
  a.mirror = is_a(remote, classes.remote_tensor);
  bool grouped = false;
  if (group && !a.mirror) {
    try {
      grouped = group_views(local, remote, a);
    } catch (...) {  // the view by view parse below names the problem
      a = CallArgs{};
      a.mirror = false;
    }
  }
  if (!grouped) {
    unpack(local, true, a);
    unpack(remote, false, a);
  }
  a.notify = notify_tag(notify);
  if (!timeout.is_none()) {
    const double t = PyFloat_AsDouble(timeout.ptr());  // a number, as Python's `timeout <= 0` needs
    if (t == -1.0 && PyErr_Occurred()) throw py::error_already_set();
    if (!(t > 0)) throw py::value_error(cat("timeout must be positive, not ", py::str(timeout).cast<std::string>()));
    a.timeout = t;
  }
  return a;
}

// Calls `use` with the call's arguments grouped (group_views); if the engine refuses the
// grouped form, with the arguments view by view, whose verdict is the call's.
template <typename Use>
auto with_call_args(py::handle local, py::handle remote, py::handle notify, py::handle timeout, Use&& use) {
  {
    CallArgs a = call_args(local, remote, notify, timeout, true);
    if (!a.grouped) return use(a);
    try {
      return use(a);
    } catch (const Error&) {
    }
  }
  CallArgs a = call_args(local, remote, notify, timeout, false);
  return use(a);
}

// p2p.pages(base, ids, dim): a Pages made here when its arguments need no conversion and no
// check fails (a plain tensor or an exact RemoteTensor, ids a 1-d contiguous int64 CPU tensor,
// dim an int in range), which costs a fifth of Pages.__init__ (its isinstance checks and
// RemoteTensor.dim() make Python objects); anything else goes to Pages(base, ids, dim), which
// converts the ids or raises. A paged call makes two of these per entry.
py::object make_pages(py::handle base, py::handle ids, py::handle dim) {
  P2P_CHECK(classes.pages, ErrorKind::Generic, "torch_p2p.engine did not set up its classes");
  int64_t ndim = -1;
  if (THPVariable_CheckExact(base.ptr())) {
    ndim = THPVariable_Unpack(base.ptr()).dim();
  } else if (Py_TYPE(base.ptr()) == reinterpret_cast<PyTypeObject*>(classes.remote_tensor)) {
    if (const std::shared_ptr<RemoteView>* v = view_of(base.ptr())) ndim = static_cast<int64_t>((*v)->shape.size());
  }
  bool plain = ndim > 0 && THPVariable_CheckExact(ids.ptr()) && PyLong_CheckExact(dim.ptr());
  int64_t d = 0;
  if (plain) {
    const at::Tensor& t = THPVariable_Unpack(ids.ptr());
    int overflow = 0;
    d = PyLong_AsLongLongAndOverflow(dim.ptr(), &overflow);
    plain = page_id_tensor(t) && !overflow && -ndim <= d && d < ndim;
  }
  if (!plain) return py::reinterpret_borrow<py::object>(classes.pages)(base, ids, dim);
  PyTypeObject* type = reinterpret_cast<PyTypeObject*>(classes.pages);
  py::object out = py::reinterpret_steal<py::object>(type->tp_alloc(type, 0));
  if (!out) throw py::error_already_set();
  const py::int_ normalized(d < 0 ? d + ndim : d);
  if (PyObject_SetAttr(out.ptr(), interned(base_name), base.ptr()) < 0 ||
      PyObject_SetAttr(out.ptr(), interned(ids_name), ids.ptr()) < 0 ||
      PyObject_SetAttr(out.ptr(), interned(dim_name), normalized.ptr()) < 0)
    throw py::error_already_set();
  return out;
}

// RemoteTensor.__getitem__ and .view: views made natively (a user builds one per page, hundreds
// per call), returned as a RemoteTensor made without calling its Python constructor.
const RemoteView& remote_view_of(py::handle remote, py::object& holder) {
  if (const std::shared_ptr<RemoteView>* v = view_of(remote.ptr())) return **v;
  holder = attribute(remote, view_name);  // names what is missing
  return holder.cast<const RemoteView&>();
}

py::object remote_tensor(PyTypeObject* type, std::shared_ptr<RemoteView> view) {
  py::object v = py::cast(std::move(view));
  py::object out = py::reinterpret_steal<py::object>(type->tp_alloc(type, 0));
  if (!out) throw py::error_already_set();
  if (PyObject_SetAttr(out.ptr(), interned(view_name), v.ptr()) < 0) throw py::error_already_set();
  return out;
}

py::object remote_index(py::handle self, py::handle index) {
  py::object holder;
  const RemoteView& v = remote_view_of(self, holder);
  PyObject* idx = index.ptr();
  const bool tuple = PyTuple_Check(idx);
  const Py_ssize_t n = tuple ? PyTuple_GET_SIZE(idx) : 1;
  PyObject* const* objs = tuple ? reinterpret_cast<PyTupleObject*>(idx)->ob_item : &idx;
  // Counted before any item is parsed, as Python's indexing did.
  size_t specified = 0, ellipses = 0;
  for (Py_ssize_t k = 0; k < n; ++k) {
    specified += objs[k] != Py_None && objs[k] != Py_Ellipsis;
    ellipses += objs[k] == Py_Ellipsis;
  }
  if (specified > v.shape.size())
    throw py::index_error(cat("too many indices for a RemoteTensor of dimension ", v.shape.size()));
  if (ellipses > 1) throw py::index_error("an index can only have a single ellipsis ('...')");
  IndexItem stack[8];
  std::vector<IndexItem> heap;
  IndexItem* items = stack;
  if (n > 8) {
    heap.resize(n);
    items = heap.data();
  }
  for (Py_ssize_t k = 0; k < n; ++k) {
    PyObject* o = objs[k];
    IndexItem& item = items[k];
    if (o == Py_None) {
      item.kind = IndexItem::Kind::NewAxis;
    } else if (o == Py_Ellipsis) {
      item.kind = IndexItem::Kind::Ellipsis;
    } else if (PySlice_Check(o)) {
      Py_ssize_t start, stop, step;
      if (PySlice_Unpack(o, &start, &stop, &step) < 0) throw py::error_already_set();
      item = {IndexItem::Kind::Slice, start, stop, step};
    } else if (PyLong_CheckExact(o)) {
      int overflow = 0;
      item = {IndexItem::Kind::Int, PyLong_AsLongLongAndOverflow(o, &overflow)};
      if (overflow) throw py::index_error(cat("index ", py::str(o).cast<std::string>(), " is out of bounds"));
    } else {
      if (PyBool_Check(o) || (THPVariable_Check(o) && THPVariable_Unpack(o).scalar_type() == at::kBool))
        throw py::type_error("RemoteTensor supports basic indexing only (no masks)");
      PyObject* i = PyNumber_Index(o);
      if (!i) {
        PyErr_Clear();
        throw py::type_error(cat("RemoteTensor supports basic indexing only: ints, slices, ... and None, not ",
                                 type_name(o)));
      }
      const py::object number = py::reinterpret_steal<py::object>(i);
      int overflow = 0;
      item = {IndexItem::Kind::Int, PyLong_AsLongLongAndOverflow(i, &overflow)};
      if (overflow) throw py::index_error(cat("index ", py::str(number).cast<std::string>(), " is out of bounds"));
    }
  }
  return remote_tensor(Py_TYPE(self.ptr()), v.index(items, n));
}

// remote.view(2, 3), remote.view((2, 3)), remote.view(torch.Size([6])).
py::object remote_reshape(py::handle self, const py::args& args) {
  py::object holder;
  const RemoteView& v = remote_view_of(self, holder);
  py::handle dims = args;
  if (args.size() == 1 && !PyLong_Check(args[0].ptr()) && PySequence_Check(args[0].ptr())) dims = args[0];
  std::vector<int64_t> shape;
  for (py::handle d : py::reinterpret_borrow<py::iterable>(dims)) {
    PyObject* i = PyNumber_Index(d.ptr());
    if (!i) {
      PyErr_Clear();
      throw py::type_error(cat("RemoteTensor.view takes a shape (ints), not ", type_name(d)));
    }
    const py::object number = py::reinterpret_steal<py::object>(i);
    int overflow = 0;
    shape.push_back(PyLong_AsLongLongAndOverflow(i, &overflow));
    if (overflow) throw py::value_error(cat("RemoteTensor.view: dimension ", py::str(number).cast<std::string>(),
                                            " is too large"));
  }
  return remote_tensor(Py_TYPE(self.ptr()), v.reshaped(std::move(shape)));
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

py::tuple completion_tuple(Completion& c, py::object future) {
  py::object payload = py::none(), address = py::none();
  if (!c.address.empty()) {
    payload = py::bytes(c.payload);
    address = py::bytes(c.address);
  }
  return py::make_tuple(std::move(future), static_cast<int>(c.status.kind), text(c.status.message), payload, address);
}

// A list or tuple of Python ints, each in [0, count) and, with `unique`, no two alike, as an
// int64 tensor; None for anything else, which the caller then checks the slow way (naming the
// problem). A KV request's block tables come through here (Python takes 15 us for 256 ids).
py::object checked_ids(const py::handle& seq, int64_t count, bool unique) {
  const bool list = PyList_Check(seq.ptr());
  if (!list && !PyTuple_Check(seq.ptr())) return py::none();
  const Py_ssize_t n = list ? PyList_GET_SIZE(seq.ptr()) : PyTuple_GET_SIZE(seq.ptr());
  at::Tensor out = at::empty({static_cast<int64_t>(n)}, at::kLong);
  int64_t* ids = out.data_ptr<int64_t>();
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = list ? PyList_GET_ITEM(seq.ptr(), i) : PyTuple_GET_ITEM(seq.ptr(), i);
    if (!PyLong_CheckExact(item)) return py::none();
    int overflow = 0;
    const long long id = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (overflow || id < 0 || id >= count) return py::none();
    ids[i] = id;
  }
  thread_local std::vector<uint8_t> table;  // repeated_id's, zero between calls
  if (unique && repeated_id(ids, n, count, table) >= 0) return py::none();
  return py::cast(out);
}

// ids (a 1-d contiguous int64 CPU tensor), then each id + offset: a kvflat cache's K and V
// pages of the same blocks, without two torch operations on a request's critical path.
at::Tensor stacked_ids(const at::Tensor& ids, int64_t offset) {
  check_page_id_tensor(ids);
  const int64_t n = ids.numel();
  at::Tensor out = at::empty({2 * n}, at::kLong);
  const int64_t* in = ids.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t k = 0; k < n; ++k) {
    o[k] = in[k];
    o[n + k] = in[k] + offset;
  }
  return out;
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

  m.def("provider_limits", [](const std::string& provider) {
    Config c;
    read_environment(c, {"provider"});
    fabric::Offer offer = fabric::query(provider, true, c.query_options());
    const fabric::Limits l = fabric::limits(*offer.list);
    py::dict d;
    d["provider"] = offer.provider;
    d["fabric"] = std::string(offer.list->fabric_attr->name);
    d["hmem"] = offer.hmem;
    d["delivery_complete"] = offer.delivery_complete;
    d["auto_progress"] = offer.auto_progress;
    d["mr_mode"] = l.mr_mode;
    d["iov_limit"] = l.iov_limit;
    d["rma_iov_limit"] = l.rma_iov_limit;
    d["inject_size"] = l.inject_size;
    d["max_msg_size"] = l.max_msg_size;
    d["cq_data_size"] = l.cq_data_size;
    d["mr_key_size"] = l.mr_key_size;
    d["dmabuf"] = l.dmabuf;
    d["nics"] = nic_list(offer);
    return d;
  }, py::arg("provider"), "What a provider grants the engine's query: its limits, modes and NICs (a dict).");

  m.def("provider_profile", [](const std::string& provider) {
    const fabric::Profile& p = fabric::profile(provider);
    py::dict d;
    d["name"] = p.name;
    d["default_rank"] = p.default_rank;
    d["remote"] = p.remote;
    d["rdma"] = p.rdma;
    d["dmabuf"] = p.dmabuf;
    d["auto_progress"] = p.auto_progress;
    d["rails_from_cores"] = p.rails_from_cores;
    d["max_chunk"] = p.max_chunk;
    d["unchecked_fast_rma"] = p.unchecked_fast_rma;
    d["cuda_ipc_rma"] = p.cuda_ipc_rma;
    d["own_endpoint_names"] = p.own_endpoint_names;
    d["peers_must_release"] = p.peers_must_release;
    d["target_progress"] = p.target_progress;
    d["shares_own_endpoints"] = p.shares_own_endpoints;
    d["known_problem"] = p.known_problem ? py::object(py::str(p.known_problem)) : py::none();
    return d;
  }, py::arg("provider"), "What the engine does differently on a provider (csrc/fabric/profile.h), a dict.");
  m.def("registration", [](const std::string& provider, bool hmem, bool dmabuf, const std::string& memory) {
    using fabric::MemoryKind;
    const MemoryKind kind = memory == "host" ? MemoryKind::Host : memory == "cuda" ? MemoryKind::Cuda
                            : memory == "cuda_vmm" ? MemoryKind::CudaVmm
                            : throw Error(ErrorKind::Value, cat("memory must be 'host', 'cuda' or 'cuda_vmm', not '", memory, "'"));
    const fabric::RegistrationChoice c = fabric::choose_registration(fabric::profile(provider), hmem, dmabuf, kind);
    return py::make_tuple(fabric::name(c.how), c.why);
  }, py::arg("provider"), py::arg("hmem"), py::arg("dmabuf"), py::arg("memory"),
     "How memory of a kind registers with a provider whose answer has FI_HMEM (hmem) and FI_MR_DMABUF (dmabuf): "
     "(\"host\" | \"hmem\" | \"dmabuf\" | \"staged\", why). csrc/fabric/registration.h.");
  m.def("provider_names", [] {
    std::vector<std::string> names;
    for (const fabric::Profile& p : fabric::profiles()) names.push_back(p.name);
    return names;
  }, "The providers the profile table knows.");
  m.def("default_providers", &fabric::default_providers, "What Engine(provider=None) tries, in order.");

  m.def("checked_ids", &checked_ids, py::arg("ids"), py::arg("count"), py::arg("unique"),
        "A list or tuple of ints in [0, count) (distinct with unique) as an int64 tensor; else None.");

  m.def("stacked_ids", &stacked_ids, py::arg("ids"), py::arg("offset"),
        "ids, then each id + offset, as one int64 tensor (a kvflat cache's K and V pages).");

  m.def("settings", [] {
    py::list rows;
    for (const SettingInfo& r : setting_table()) rows.append(py::make_tuple(r.key, r.variable, r.default_text));
    return rows;
  }, "The settings table (csrc/core/config.h): [(key, TORCH_P2P_* variable or '', default as text)].");

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
      .def_property_readonly("shape", [](const RemoteView& v) { return c10::IntArrayRef(v.shape).vec(); })
      .def_property_readonly("strides", [](const RemoteView& v) { return c10::IntArrayRef(v.strides).vec(); })
      .def_property_readonly("offset", [](const RemoteView& v) { return v.offset; })
      .def_property_readonly("element_size", &RemoteView::elem)
      .def_property_readonly("owner", [](const RemoteView& v) { return py::bytes(v.region->owner); })
      .def_property_readonly("region_id", [](const RemoteView& v) { return v.region->id; })
      .def_property_readonly("nbytes", [](const RemoteView& v) { return v.region->nbytes; })
      .def_property_readonly("access", [](const RemoteView& v) { return v.region->access; })
      .def_property_readonly("staged", [](const RemoteView& v) { return !v.region->on_nics; })
      .def_property_readonly("device", [](const RemoteView& v) {
        return v.region->device_type == 1 ? "cuda:" + std::to_string(v.region->device_index) : std::string("cpu");
      })
      .def_property_readonly("keys", [](const RemoteView& v) { return v.region->key; })
      .def_property_readonly("rails", [](const RemoteView& v) { return v.region->rails; })
      .def("view", &RemoteView::view)
      .def("to_bytes", [](const RemoteView& v) { return py::bytes(v.encode()); })
      .def_static("from_bytes", [](const py::bytes& b) { return RemoteView::decode(std::string(b)); });

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
      .def_property_readonly("rails", [](const Engine& e) {
        py::list out;
        for (const auto& r : e.rails()) {
          py::dict d;
          d["domain"] = r.domain;
          d["fabric"] = r.fabric;
          d["tx_depth"] = r.tx_depth;
          d["wait_fd"] = r.wait_fd;
          d["cuda_ipc"] = r.cuda_ipc;
          out.append(d);
        }
        return out;
      })
      .def("register", [](Engine& e, const at::Tensor& t, const std::string& access, double timeout) {
        py::gil_scoped_release release;
        return e.register_tensor(t, access, timeout);
      })
      .def("deregister", &Engine::deregister, py::call_guard<py::gil_scoped_release>())
      // write_slices (write) / read_slices with the user's arguments as they came (call_args).
      .def("submit", [](Engine& e, const py::object& future, bool write, py::handle local, py::handle remote,
                        py::handle notify, py::handle timeout) {
        start(e, future, [&](uint64_t id) {
          // A host call keeps the GIL: it may be copied here (core/caller_copies.h), and in a process
          // whose other threads keep the GIL busy (vLLM's workers) each release cost a wait for it.
          // A CUDA call lets it go, as it did before that (it asks CUDA about the caller's stream).
          with_call_args(local, remote, notify, timeout, [&](const CallArgs& a) {
            std::optional<py::gil_scoped_release> release;
            if (std::any_of(a.local.begin(), a.local.end(), [](const at::Tensor& t) { return t.is_cuda(); }))
              release.emplace();
            e.submit(id, write, a.local, a.remote, a.local_pages, a.remote_pages, a.mirror, a.notify, a.timeout);
          });
        });
      })
      .def("prepare", [](Engine& e, bool write, py::handle local, py::handle remote, py::handle notify,
                         py::handle timeout) {
        return with_call_args(local, remote, notify, timeout, [&](const CallArgs& a) {
          py::gil_scoped_release release;
          return e.prepare(write, a.local, a.remote, a.local_pages, a.remote_pages, a.mirror, a.notify, a.timeout);
        });
      })
      .def("run", [](Engine& e, const py::object& future, const std::shared_ptr<Engine::Prepared>& call) {
        start(e, future, [&](uint64_t id) {
          std::optional<py::gil_scoped_release> release;  // as submit
          if (call->cuda) release.emplace();
          e.run(id, *call);
        });
      })
      .def("run_pages", [](Engine& e, const py::object& future, const std::shared_ptr<Engine::Prepared>& call,
                           py::handle lids, py::handle rids, py::handle notify) {
        const int64_t tag = notify_tag(notify);
        const at::Tensor& l = page_ids(lids);
        const at::Tensor& r = page_ids(rids);
        start(e, future, [&](uint64_t id) {
          std::optional<py::gil_scoped_release> release;  // as submit
          if (call->cuda) release.emplace();
          e.run_pages(id, *call, l, r, tag);
        });
      })
      .def("route", [](Engine& e, const py::bytes& address, std::shared_ptr<RemoteView> view) {
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
      .def("send", [](Engine& e, const py::object& future, const py::bytes& a, const py::bytes& payload, double timeout) {
        start(e, future, [&](uint64_t id) { e.send(id, a, std::string(payload), timeout); });
      })
      .def("recv", [](Engine& e, const py::object& future, double timeout) {
        start(e, future, [&](uint64_t id) { e.recv(id, timeout); });
      })
      .def("notification", [](Engine& e, const py::object& future, uint32_t tag, double timeout) {
        start(e, future, [&](uint64_t id) { e.notification(id, tag, timeout); });
      })
      .def("cancel", [](Engine& e, const py::object& future) {
        e.cancel(future.cast<std::shared_ptr<torch::jit::PythonFutureWrapper>>()->fut);
      })
      .def("poll", [](Engine& e, int timeout_ms) {
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
      })
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
        auto fut = future.cast<std::shared_ptr<torch::jit::PythonFutureWrapper>>()->fut;
        py::gil_scoped_release release;
        e.stream_wait(reinterpret_cast<void*>(stream), fut);
      });

  m.def("remote_index", &remote_index, py::arg("remote"), py::arg("index"),
        "remote[index] for a RemoteTensor: the view basic indexing gives, as a RemoteTensor.");
  m.def("remote_view", &remote_reshape, py::arg("remote"),
        "remote.view(*shape) for a RemoteTensor: torch.Tensor.view's shape rules, as a RemoteTensor.");
  m.def("_pages", &make_pages, py::arg("base"), py::arg("ids"), py::arg("dim"),
        "p2p.pages(): a Pages of a tensor or RemoteTensor (see torch_p2p.engine.pages).");
  m.def("_wait_done", &wait_done, py::arg("future"), py::arg("spin_us"), py::arg("timeout_s"),
        "Whether `future` completed within timeout_s (inf: no limit), first spinning up to spin_us; "
        "the GIL released, Python's signal handlers run every 50 ms.");
  m.def("_set_classes", [](py::object pages, py::object remote_tensor, py::object sequence) {
    classes = {pages.release().ptr(), remote_tensor.release().ptr(), sequence.release().ptr()};
  }, "torch_p2p.engine's Pages, RemoteTensor and collections.abc.Sequence, for write_slices' arguments.");
  bind_wire(m);
}
