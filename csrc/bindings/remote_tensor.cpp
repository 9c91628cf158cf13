// RemoteView as torch_p2p._C.RemoteView, and RemoteTensor's views (__getitem__, .view) made
// natively: a user builds one per page, hundreds per call. A new view is returned as a
// RemoteTensor made without calling its Python constructor.
#include <torch/csrc/autograd/python_variable.h>  // THPVariable_Check, THPVariable_Unpack

#include "bindings/bindings.h"
#include "bindings/objects.h"
#include "common/error.h"

namespace p2p::bindings {

using engine::IndexItem;

namespace {

// The RemoteView of `remote`, read in place where it can be; `keep` holds it otherwise.
const RemoteView& view_in(py::handle remote, std::shared_ptr<RemoteView>& keep) {
  if (classes.remote_tensor && is_a(remote, classes.remote_tensor))
    if (const RemoteViewHolder* h = held_view(remote.ptr())) return **h;
  keep = remote_view(remote);  // names what is missing
  return *keep;
}

py::object remote_tensor(PyTypeObject* type, std::shared_ptr<RemoteView> view) {
  py::object v = py::cast(std::move(view));
  py::object out = py::reinterpret_steal<py::object>(type->tp_alloc(type, 0));
  if (!out) throw py::error_already_set();
  if (PyObject_SetAttr(out.ptr(), interned(view_name), v.ptr()) < 0) throw py::error_already_set();
  return out;
}

// An item of an index that is neither None, ... nor a slice: an int, or what __index__ makes one.
IndexItem int_item(PyObject* o) {
  if (PyLong_CheckExact(o)) {  // the usual item, read without a new reference
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (!overflow) return {IndexItem::Kind::Int, v};
  } else if (PyBool_Check(o) || (THPVariable_Check(o) && THPVariable_Unpack(o).scalar_type() == at::kBool)) {
    throw py::type_error("RemoteTensor supports basic indexing only (no masks)");
  }
  const Index i = as_index(o, "RemoteTensor supports basic indexing only: ints, slices, ... and None, not ");
  if (i.overflow) throw py::index_error(cat("index ", i.text(), " is out of bounds"));
  return {IndexItem::Kind::Int, i.value};
}

py::object remote_index(py::handle self, py::handle index) {
  std::shared_ptr<RemoteView> keep;
  const RemoteView& v = view_in(self, keep);
  PyObject* idx = index.ptr();
  const bool tuple = PyTuple_Check(idx);
  const Py_ssize_t n = tuple ? PyTuple_GET_SIZE(idx) : 1;
  PyObject* const* objs = tuple ? reinterpret_cast<PyTupleObject*>(idx)->ob_item : &idx;
  // Counted before any item is parsed, as torch's indexing does.
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
    if (o == Py_None) {
      items[k].kind = IndexItem::Kind::NewAxis;
    } else if (o == Py_Ellipsis) {
      items[k].kind = IndexItem::Kind::Ellipsis;
    } else if (PySlice_Check(o)) {
      Py_ssize_t start, stop, step;
      if (PySlice_Unpack(o, &start, &stop, &step) < 0) throw py::error_already_set();
      items[k] = {IndexItem::Kind::Slice, start, stop, step};
    } else {
      items[k] = int_item(o);
    }
  }
  return remote_tensor(Py_TYPE(self.ptr()), v.index(items, n));
}

// remote.view(2, 3), remote.view((2, 3)), remote.view(torch.Size([6])).
py::object remote_reshape(py::handle self, const py::args& args) {
  std::shared_ptr<RemoteView> keep;
  const RemoteView& v = view_in(self, keep);
  py::handle dims = args;
  if (args.size() == 1 && !PyLong_Check(args[0].ptr()) && PySequence_Check(args[0].ptr())) dims = args[0];
  std::vector<int64_t> shape;
  for (py::handle d : py::reinterpret_borrow<py::iterable>(dims)) {
    const Index i = as_index(d, "RemoteTensor.view takes a shape (ints), not ");
    if (i.overflow) throw py::value_error(cat("RemoteTensor.view: dimension ", i.text(), " is too large"));
    shape.push_back(i.value);
  }
  return remote_tensor(Py_TYPE(self.ptr()), v.reshaped(std::move(shape)));
}

}  // namespace

void bind_remote(py::module_& m) {
  RemoteViewClass(m, "RemoteView")
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

  m.def("remote_index", &remote_index, py::arg("remote"), py::arg("index"),
        "remote[index] for a RemoteTensor: the view basic indexing gives, as a RemoteTensor.");
  m.def("remote_view", &remote_reshape, py::arg("remote"),
        "remote.view(*shape) for a RemoteTensor: torch.Tensor.view's shape rules, as a RemoteTensor.");
}

}  // namespace p2p::bindings
