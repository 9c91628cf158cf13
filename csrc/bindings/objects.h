// The Python objects the bindings read in place: torch_p2p's classes (set once by
// torch_p2p.engine), attribute names interned once, and a RemoteTensor's RemoteView read from
// its slot without an attribute lookup or pybind11's caster (call_args.cpp says what for).
//
// Those reads rely on CPython's member-descriptor slots and on pybind11's instance layout; each
// is checked once, on the live classes, when torch_p2p.engine sets its classes (set_classes),
// and a read whose check failed is off: the safe path (getattr and pybind11's caster) does its
// work. fast_paths() says which are on; tests/test_bindings.py asserts they all are, so that a
// torch, pybind11 or Python upgrade that breaks one fails a test instead of a call.
#pragma once

#include <torch/csrc/utils/pybind.h>  // pybind11 with torch's casters

#include <memory>
#include <string>

#include "engine/remote_view.h"

namespace p2p::bindings {

namespace py = pybind11;
using engine::RemoteView;

// The one definition of how RemoteView is bound (module.cpp): the in-place reads below take
// its holder type from here.
using RemoteViewClass = py::class_<RemoteView, std::shared_ptr<RemoteView>>;
using RemoteViewHolder = RemoteViewClass::holder_type;

// torch_p2p.engine's Pages, torch_p2p.remote.RemoteTensor and collections.abc.Sequence,
// references kept for good.
struct Classes {
  PyObject* pages = nullptr;
  PyObject* remote_tensor = nullptr;
  PyObject* sequence = nullptr;
};
extern Classes classes;
// Sets them and checks the in-place reads against them; the module's _set_classes.
void set_classes(py::object pages, py::object remote_tensor, py::object sequence);
// A Generic error unless set_classes ran (torch_p2p.engine was imported).
void require_classes();

// The in-place reads in force (set_classes decides them).
struct FastReads {
  Py_ssize_t view_offset = -1;                      // of RemoteTensor._v's slot; -1: getattr
  const py::detail::type_info* view_type = nullptr;  // RemoteView's; null: pybind11's caster
};
extern FastReads fast_reads;
py::dict fast_paths();      // which are on, by name (also the futures' and view_pages')
void disable_fast_paths();  // for tests of the safe paths

// isinstance() through the type's MRO only, without calling __instancecheck__ (Pages and
// RemoteTensor define none) as PyObject_IsInstance does when the type is not the exact one.
inline bool is_a(py::handle obj, PyObject* cls) {
  return PyObject_TypeCheck(obj.ptr(), reinterpret_cast<PyTypeObject*>(cls));
}
bool is_instance(py::handle obj, PyObject* cls);  // PyObject_IsInstance
std::string type_name(py::handle obj);
// Messages may quote bytes from peers or users: decoded leniently.
py::str text(const std::string& message);

// An integer argument read through __index__ (an int, a NumPy integer, a 0-d integer tensor).
struct Index {
  py::object number;  // the int __index__ gave
  int64_t value = 0;
  bool overflow = false;  // number does not fit int64
  std::string text() const { return py::str(number).cast<std::string>(); }
};
// TypeError `not_an_int` followed by obj's type name where obj has no __index__.
Index as_index(py::handle obj, const char* not_an_int);

// An attribute name, interned at its first use (a lookup by C string makes a Python string
// each time); kept for good.
struct Name {
  const char* text;
  PyObject* interned = nullptr;
};
extern Name ids_name, dim_name, base_name, view_name;
PyObject* interned(Name& name);
py::object attribute(py::handle obj, Name& name);

// The holder of the RemoteView that RemoteTensor (or subclass) `obj`'s slot holds, read in
// place; null where a read is off or the slot holds no exact RemoteView.
inline const RemoteViewHolder* held_view(PyObject* obj) {
  const FastReads& f = fast_reads;
  if (f.view_offset < 0 || !f.view_type) return nullptr;
  PyObject* v = *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj) + f.view_offset);  // obj holds it
  if (!v || Py_TYPE(v) != f.view_type->type) return nullptr;
  // pybind11's own accessor for an instance of exactly this type (what its caster reads).
  py::detail::value_and_holder vh(reinterpret_cast<py::detail::instance*>(v), f.view_type, 0, 0);
  return vh.holder_constructed() ? &vh.holder<RemoteViewHolder>() : nullptr;
}

// Whether pybind11's record of a type says its holder is a std::shared_ptr of `size` bytes, as
// the in-place reads of holders assume.
inline bool shared_ptr_holder(const py::detail::type_info* info, size_t size) {
  if (!info || info->holder_size_in_ptrs != py::detail::size_in_ptrs(size)) return false;
#if PYBIND11_VERSION_MAJOR >= 3
  return info->holder_enum_v == py::detail::holder_enum_t::std_shared_ptr;
#else
  return !info->default_holder;
#endif
}

// The RemoteView of an exact RemoteTensor, read in place; else null.
inline const RemoteView* exact_remote_view(PyObject* obj) {
  if (Py_TYPE(obj) != reinterpret_cast<PyTypeObject*>(classes.remote_tensor)) return nullptr;
  const RemoteViewHolder* h = held_view(obj);
  return h ? h->get() : nullptr;
}

// The RemoteView of a RemoteTensor (any subclass): read in place, else through getattr and
// pybind11's caster, which name what is missing.
std::shared_ptr<RemoteView> remote_view(py::handle obj);

}  // namespace p2p::bindings
