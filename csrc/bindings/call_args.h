// The arguments of write_slices / read_slices / prepare_* as the engine takes them, taken apart
// from the Python objects the user passed (call_args.cpp says why by hand), and the checks of a
// call's scalar arguments (notify, timeout, tags), written once for every binding that takes them.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <vector>

#include "common/error.h"
#include "engine/engine.h"

namespace p2p::bindings {

namespace py = pybind11;

struct CallArgs {
  std::vector<at::Tensor> local;
  std::vector<std::shared_ptr<engine::RemoteView>> remote;
  std::vector<engine::Engine::Pages> local_pages, remote_pages;
  std::vector<size_t> grouped;  // entries that are view pairs taken as pages (engine/view_pages.h)
  bool mirror = false;
  int64_t notify = -1;
  double timeout = 0;  // 0: the engine's default
};

// The call's arguments; view pairs grouped into pages where they can be.
CallArgs call_args(py::handle local, py::handle remote, py::handle notify, py::handle timeout);
// The grouped entries back as the view pairs they were made of (same order, same indices).
void ungroup(CallArgs& a);

// A tag (notification(tag), notify=): an int in [0, 2^32); ValueError naming `what` otherwise.
uint32_t tag_arg(py::handle tag, const char* what);
// notify=: None (-1) or a tag.
int64_t notify_arg(py::handle notify);
// timeout=: a positive number of seconds, or None: 0, the engine's default for transfers and
// messages, no deadline for recv() and notification().
double timeout_arg(py::handle timeout);
// Page ids as Pages and run_pages hold them: a tensor (its form is checked where it is used).
const at::Tensor& page_ids(py::handle ids);

// Calls `use` with the call's arguments; where the engine refuses the grouped form (a Value or
// Index error: pages refuse a destination page named twice, where views of one place are
// allowed), with the same arguments view by view, whose verdict is the call's.
template <typename Use>
auto with_call_args(py::handle local, py::handle remote, py::handle notify, py::handle timeout, Use&& use) {
  CallArgs a = call_args(local, remote, notify, timeout);
  if (a.grouped.empty()) return use(a);
  try {
    return use(a);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::Value && e.kind() != ErrorKind::Index) throw;
  }
  ungroup(a);
  return use(a);
}

}  // namespace p2p::bindings
