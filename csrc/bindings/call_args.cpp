// NOTE: write_slices' arguments are taken apart here, by hand, not by Python and not by
// pybind11's casters: a small paged call is bound by its cost per call. `python
// benchmarks/views.py --pybind11 --page-bytes 4K` (docs/performance_calls.md): for 256 pairs of 4 KiB
// views the whole parse (taken apart, checked, decomposed) cost 25.2 us a call, while pybind11's
// casters alone, doing nothing else, took 51.4 us for the list of tensors and 68.1 us for the
// list of RemoteTensors: 4.7 x the whole parse. The parse stands while that benchmark says so.
//
// What it relies on beyond the public C API is read through objects.h (a RemoteTensor's slot,
// pybind11's holder) and engine/view_pages.h (a TensorImpl made without the dispatcher), each
// checked once and replaced by the safe path where its check fails. Messages and the order of
// checks are those of a parse view by view: all local views first, then the remote ones.
#include "bindings/call_args.h"

#include <torch/csrc/autograd/python_variable.h>  // THPVariable_Check, THPVariable_Unpack

#include "bindings/objects.h"
#include "engine/view_pages.h"

namespace p2p::bindings {

using engine::Engine;
using engine::RemoteView;

namespace {

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
    a.remote.push_back(remote_view(base));
    a.remote_pages.push_back(std::move(pages));
  }
}

// One side: a tensor (local) or RemoteTensor (remote), a Pages of one, or a sequence of them.
void unpack(py::handle views, bool local, CallArgs& a) {
  PyObject* v = views.ptr();
  if (THPVariable_Check(v) || is_a(views, classes.remote_tensor) || is_a(views, classes.pages))
    return add_item(0, views, local, a);
  if (PyList_Check(v) || PyTuple_Check(v)) {
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(v); ++i) add_item(i, PySequence_Fast_GET_ITEM(v, i), local, a);
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

// Both sides lists (or tuples) of one length: their pairs, grouped into pages where they are
// pages (engine/view_pages.h); false for other shapes. The runs are found first, from what the
// pairs are read as in place; then each side's entries are made in order, so that the first
// item that is neither a tensor nor a Pages of one is the one a view by view parse names.
bool group_views(py::handle local, py::handle remote, CallArgs& a) {
  PyObject *l = local.ptr(), *r = remote.ptr();
  if (!(PyList_Check(l) || PyTuple_Check(l)) || !(PyList_Check(r) || PyTuple_Check(r))) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(l);
  if (n < 2 || PySequence_Fast_GET_SIZE(r) != n) return false;
  PyObject** litems = PySequence_Fast_ITEMS(l);
  PyObject** ritems = PySequence_Fast_ITEMS(r);
  // Kept between calls: fresh buffers of a few KiB each per call made the allocator
  // consolidate its free lists every time.
  thread_local std::vector<engine::ViewPair> pairs;
  thread_local std::vector<int64_t> loffsets, roffsets;
  thread_local std::vector<size_t> ends;  // of each entry's pairs
  thread_local std::vector<engine::PagedPair> groups;
  struct Release {  // the groups' tensors, also where an item is refused
    ~Release() { groups.clear(); }
  } release;
  pairs.resize(n);
  for (Py_ssize_t i = 0; i < n; ++i)
    pairs[i] = {THPVariable_CheckExact(litems[i]) ? &THPVariable_Unpack(litems[i]) : nullptr,
                exact_remote_view(ritems[i])};
  ends.clear();
  groups.clear();
  for (size_t i = 0; i < static_cast<size_t>(n);) {
    const size_t j = engine::page_run(pairs.data(), n, i, loffsets, roffsets);
    if (j - i >= 2) groups.push_back(engine::paged_pair(*pairs[i].local, *pairs[i].remote, loffsets.data(), roffsets.data(), j - i));
    ends.push_back(j);
    i = j;
  }
  for (bool local_side : {true, false}) {
    size_t g = 0, i = 0;
    for (size_t end : ends) {
      if (end - i < 2) {
        add_item(i, (local_side ? litems : ritems)[i], local_side, a);
      } else if (local_side) {
        a.grouped.push_back(a.local.size());
        a.local.push_back(std::move(groups[g].local));
        a.local_pages.emplace_back(std::make_tuple(std::move(groups[g++].lids), int64_t{0}));
      } else {
        a.remote.push_back(std::move(groups[g].remote));
        a.remote_pages.emplace_back(std::make_tuple(std::move(groups[g++].rids), int64_t{0}));
      }
      i = end;
    }
  }
  return true;
}

}  // namespace

CallArgs call_args(py::handle local, py::handle remote, py::handle notify, py::handle timeout) {
  require_classes();
  CallArgs a;
  a.mirror = is_a(remote, classes.remote_tensor);
  if (a.mirror || !group_views(local, remote, a)) {
    unpack(local, true, a);
    unpack(remote, false, a);
  }
  a.notify = notify_arg(notify);
  a.timeout = timeout_arg(timeout);
  return a;
}

void ungroup(CallArgs& a) {
  CallArgs out;
  out.mirror = a.mirror;
  out.notify = a.notify;
  out.timeout = a.timeout;
  size_t g = 0;
  for (size_t k = 0; k < a.local.size(); ++k) {
    if (g < a.grouped.size() && a.grouped[g] == k) {
      ++g;
      engine::PagedPair p{a.local[k], std::get<0>(*a.local_pages[k]), a.remote[k], std::get<0>(*a.remote_pages[k])};
      engine::page_views(p, out.local, out.remote);
      out.local_pages.resize(out.local.size());
      out.remote_pages.resize(out.remote.size());
    } else {
      out.local.push_back(std::move(a.local[k]));
      out.remote.push_back(std::move(a.remote[k]));
      out.local_pages.push_back(std::move(a.local_pages[k]));
      out.remote_pages.push_back(std::move(a.remote_pages[k]));
    }
  }
  a = std::move(out);
}

uint32_t tag_arg(py::handle tag, const char* what) {
  const py::int_ value(py::reinterpret_borrow<py::object>(tag));
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(value.ptr(), &overflow);
  if (overflow || v < 0 || v >= (1LL << 32))
    throw py::value_error(cat(what, " must be a 32-bit unsigned tag, not ", py::str(tag).cast<std::string>()));
  return static_cast<uint32_t>(v);
}

// Two statements, not `none ? -1 : tag_arg(...)`: that expression's type is uint32_t, in which
// -1 is tag 2^32 - 1, a notification on every call.
int64_t notify_arg(py::handle notify) {
  if (notify.is_none()) return -1;
  return tag_arg(notify, "notify");
}

double timeout_arg(py::handle timeout) {
  if (timeout.is_none()) return 0;
  const double t = PyFloat_AsDouble(timeout.ptr());  // any real number, as `timeout <= 0` takes
  if (t == -1.0 && PyErr_Occurred()) throw py::error_already_set();
  if (!(t > 0)) throw py::value_error(cat("timeout must be positive, not ", py::str(timeout).cast<std::string>()));
  return t;
}

const at::Tensor& page_ids(py::handle ids) {
  if (!THPVariable_Check(ids.ptr())) throw py::type_error(engine::kPageIdForm);
  return THPVariable_Unpack(ids.ptr());
}

}  // namespace p2p::bindings
