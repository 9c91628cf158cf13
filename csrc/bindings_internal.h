// Bindings of internals for the tests and tools, not the API: the striper, transfer states and
// peer liveness as plain functions (unit tests without an engine), and the wire encoders of
// engine addresses and RemoteTensors (tests forge and fuzz handles with them).
#pragma once

#include <pybind11/pybind11.h>

namespace p2p {
void bind_parts(pybind11::module_& m);
void bind_wire(pybind11::module_& m);
}  // namespace p2p
