#include "bindings/objects.h"

#include <structmember.h>  // PyMemberDef, T_OBJECT_EX

#include "bindings/futures.h"
#include "common/error.h"
#include "engine/view_pages.h"

namespace p2p::bindings {

Classes classes;
FastReads fast_reads;
Name ids_name{"ids"}, dim_name{"dim"}, base_name{"base"}, view_name{"_v"};

namespace {

// The offset of RemoteTensor's `_v` slot, if it is a plain object slot (a member descriptor of
// T_OBJECT_EX) and a RemoteTensor made here reads back, at that offset, what setattr stored.
Py_ssize_t view_offset(PyTypeObject* type, py::handle probe_view) {
  PyObject* d = PyDict_GetItemString(type->tp_dict, "_v");  // borrowed
  if (!d || Py_TYPE(d) != &PyMemberDescr_Type) return -1;
  const PyMemberDef* member = reinterpret_cast<PyMemberDescrObject*>(d)->d_member;
  if (member->type != T_OBJECT_EX || member->offset < static_cast<Py_ssize_t>(sizeof(PyObject)) ||
      member->offset + static_cast<Py_ssize_t>(sizeof(PyObject*)) > type->tp_basicsize)
    return -1;
  py::object obj = py::reinterpret_steal<py::object>(type->tp_alloc(type, 0));
  if (!obj) throw py::error_already_set();
  if (PyObject_SetAttr(obj.ptr(), interned(view_name), probe_view.ptr()) < 0) throw py::error_already_set();
  PyObject* read = *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj.ptr()) + member->offset);
  return read == probe_view.ptr() ? member->offset : -1;
}

// RemoteView's pybind11 type record, if its holder, read in place as held_view() reads it, is
// the one pybind11's own caster gives for a probe RemoteView.
const py::detail::type_info* view_type(py::handle probe_view, const std::shared_ptr<RemoteView>& probe) {
  const py::detail::type_info* info = py::detail::get_type_info(typeid(RemoteView));
  if (!shared_ptr_holder(info, sizeof(RemoteViewHolder))) return nullptr;
  if (Py_TYPE(probe_view.ptr()) != info->type) return nullptr;
  py::detail::value_and_holder vh(reinterpret_cast<py::detail::instance*>(probe_view.ptr()), info, 0, 0);
  if (!vh.holder_constructed() || vh.value_ptr() != probe.get()) return nullptr;
  const RemoteViewHolder& held = vh.holder<RemoteViewHolder>();
  const std::shared_ptr<RemoteView> cast = probe_view.cast<std::shared_ptr<RemoteView>>();
  return held.get() == probe.get() && cast.get() == probe.get() && held.use_count() == cast.use_count() ? info : nullptr;
}

}  // namespace

void set_classes(py::object pages, py::object remote_tensor, py::object sequence) {
  classes = {pages.release().ptr(), remote_tensor.release().ptr(), sequence.release().ptr()};
  auto probe = std::make_shared<RemoteView>();
  py::object probe_view = py::cast(probe);
  fast_reads.view_offset = view_offset(reinterpret_cast<PyTypeObject*>(classes.remote_tensor), probe_view);
  fast_reads.view_type = view_type(probe_view, probe);
  init_futures();
  engine::direct_views();
}

void require_classes() {
  P2P_CHECK(classes.pages, ErrorKind::Generic, "torch_p2p.engine did not set up its classes");
}

py::dict fast_paths() {
  py::dict d;
  d["remote_tensor_slot"] = fast_reads.view_offset >= 0;
  d["remote_view_holder"] = fast_reads.view_type != nullptr;
  d["future_init"] = futures_init_in_place();
  d["pages_without_dispatcher"] = engine::direct_views();
  return d;
}

void disable_fast_paths() {
  fast_reads = FastReads{};
  disable_futures_in_place();
  engine::disable_direct_views();
}

bool is_instance(py::handle obj, PyObject* cls) {
  const int r = PyObject_IsInstance(obj.ptr(), cls);
  if (r < 0) throw py::error_already_set();
  return r == 1;
}

std::string type_name(py::handle obj) { return py::type::handle_of(obj).attr("__name__").cast<std::string>(); }

py::str text(const std::string& message) { return py::bytes(message).attr("decode")("utf-8", "replace"); }

Index as_index(py::handle obj, const char* not_an_int) {
  PyObject* i = PyNumber_Index(obj.ptr());
  if (!i) {
    PyErr_Clear();
    throw py::type_error(cat(not_an_int, type_name(obj)));
  }
  Index out;
  out.number = py::reinterpret_steal<py::object>(i);
  int overflow = 0;
  out.value = PyLong_AsLongLongAndOverflow(i, &overflow);
  out.overflow = overflow != 0;
  return out;
}

PyObject* interned(Name& name) {
  if (!name.interned) name.interned = PyUnicode_InternFromString(name.text);
  return name.interned;
}

py::object attribute(py::handle obj, Name& name) {
  PyObject* value = PyObject_GetAttr(obj.ptr(), interned(name));
  if (!value) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(value);
}

std::shared_ptr<RemoteView> remote_view(py::handle obj) {
  if (classes.remote_tensor && is_a(obj, classes.remote_tensor))
    if (const RemoteViewHolder* h = held_view(obj.ptr())) return *h;
  return attribute(obj, view_name).cast<std::shared_ptr<RemoteView>>();
}

}  // namespace p2p::bindings
