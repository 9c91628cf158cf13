// The parts of torch_p2p._C, each bound by its own file of this folder; module.cpp calls them.
// The only files that know pybind11. torch's pieces they use, not <torch/extension.h> (the whole
// C++ frontend: nn, optim, data), which a 2-core build pays for in every file that includes it.
#pragma once

#include <pybind11/pybind11.h>

namespace p2p::bindings {

void bind_engine(pybind11::module_& m);  // engine.cpp: Setup, Engine, Prepared
void bind_remote(pybind11::module_& m);  // remote_tensor.cpp: RemoteView, RemoteTensor's views
void bind_pages(pybind11::module_& m);   // pages.cpp: p2p.pages and page id lists
void bind_facts(pybind11::module_& m);   // facts.cpp: providers, NICs, settings
void bind_parts(pybind11::module_& m);   // parts.cpp: engine parts that tests drive alone
void bind_wire(pybind11::module_& m);    // wire.cpp: wire records and messages, for tests

}  // namespace p2p::bindings
