// p2p.pages() and the page id lists of the KV cache, made natively: a paged call makes two
// Pages per entry, and a KV request's block tables are checked on its critical path.
#include <torch/csrc/autograd/python_variable.h>  // THPVariable_Check, THPVariable_Unpack

#include "bindings/bindings.h"
#include "bindings/objects.h"
#include "core/runs.h"
#include "engine/engine.h"

namespace p2p::bindings {
namespace {

// The dimensions of a tensor or RemoteTensor; TypeError for anything else.
int64_t dims_of(py::handle base) {
  if (THPVariable_Check(base.ptr())) return THPVariable_Unpack(base.ptr()).dim();
  if (is_a(base, classes.remote_tensor)) {
    if (const RemoteViewHolder* h = held_view(base.ptr())) return static_cast<int64_t>((*h)->shape.size());
    return static_cast<int64_t>(remote_view(base)->shape.size());
  }
  throw py::type_error(cat("pages() takes a tensor or a RemoteTensor, not ", type_name(base)));
}

// ids as an int64 CPU tensor: taken as it is where it is one (a KV block table usually is, and
// a conversion costs a microsecond per call, where a call may hold one entry per layer), else
// converted by torch.as_tensor.
py::object id_tensor(py::handle ids) {
  if (THPVariable_Check(ids.ptr())) {
    const at::Tensor& t = THPVariable_Unpack(ids.ptr());
    if (t.scalar_type() == at::kLong && t.is_cpu()) return py::reinterpret_borrow<py::object>(ids);
  }
  static const py::object torch = py::module_::import("torch");
  return torch.attr("as_tensor")(ids, py::arg("dtype") = torch.attr("int64"), py::arg("device") = "cpu");
}

// p2p.pages(base, ids, dim): every check of a Pages, and the Pages made without its
// constructor (Pages.__new__ comes here too).
py::object make_pages(py::handle base, py::handle ids, py::handle dim) {
  require_classes();
  const int64_t ndim = dims_of(base);
  py::object id_obj = id_tensor(ids);
  const at::Tensor& t = THPVariable_Unpack(id_obj.ptr());
  if (t.dim() != 1)
    throw py::value_error(cat("page ids must be one-dimensional, not of shape ",
                              py::str(py::tuple(py::cast(t.sizes().vec()))).cast<std::string>()));
  const Index d = as_index(dim, "the page dimension must be an int, not ");
  if (d.overflow || d.value < -ndim || d.value >= ndim)
    throw py::index_error(cat("page dimension ", py::str(dim).cast<std::string>(),
                              " is out of range for a tensor of dimension ", ndim));
  if (!t.is_contiguous()) id_obj = py::cast(t.contiguous());
  PyTypeObject* type = reinterpret_cast<PyTypeObject*>(classes.pages);
  py::object out = py::reinterpret_steal<py::object>(type->tp_alloc(type, 0));
  if (!out) throw py::error_already_set();
  const py::int_ normalized(d.value < 0 ? d.value + ndim : d.value);
  if (PyObject_SetAttr(out.ptr(), interned(base_name), base.ptr()) < 0 ||
      PyObject_SetAttr(out.ptr(), interned(ids_name), id_obj.ptr()) < 0 ||
      PyObject_SetAttr(out.ptr(), interned(dim_name), normalized.ptr()) < 0)
    throw py::error_already_set();
  return out;
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
  if (unique && core::repeated_id(ids, n, count, table) >= 0) return py::none();
  return py::cast(out);
}

// ids (a 1-d contiguous int64 CPU tensor), then each id + offset: a kvflat cache's K and V
// pages of the same blocks, without two torch operations on a request's critical path.
at::Tensor stacked_ids(const at::Tensor& ids, int64_t offset) {
  engine::check_page_id_tensor(ids);
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

void bind_pages(py::module_& m) {
  m.def("_pages", &make_pages, py::arg("base"), py::arg("ids"), py::arg("dim"),
        "p2p.pages(): a Pages of a tensor or RemoteTensor, every argument checked (see torch_p2p.engine.pages).");
  m.def("checked_ids", &checked_ids, py::arg("ids"), py::arg("count"), py::arg("unique"),
        "A list or tuple of ints in [0, count) (distinct with unique) as an int64 tensor; else None.");
  m.def("stacked_ids", &stacked_ids, py::arg("ids"), py::arg("offset"),
        "ids, then each id + offset, as one int64 tensor (a kvflat cache's K and V pages).");
}

}  // namespace p2p::bindings
