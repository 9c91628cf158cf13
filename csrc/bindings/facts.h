// Facts of the provider and the rails as Python dicts, each built from a table of the struct's
// fields (facts.cpp), so that a field added to the struct is one row here.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <tuple>
#include <vector>

#include "core/rails.h"
#include "fabric/info.h"

namespace p2p::bindings {

namespace py = pybind11;

// A field of T by its Python name: one row of a table.
template <class T, class M>
struct Field {
  const char* name;
  M T::*member;
};
#define P2P_FIELD(T, member) ::p2p::bindings::Field<T, decltype(T::member)>{#member, &T::member}

// d[name] = obj.member for each row of `table`.
template <class T, class... M>
void put_fields(py::dict& d, const T& obj, const std::tuple<Field<T, M>...>& table) {
  std::apply([&](const auto&... f) { ((d[f.name] = obj.*(f.member)), ...); }, table);
}

py::list nic_list(const fabric::Offer& offer);
py::list rail_list(const std::vector<core::RailFacts>& rails);

}  // namespace p2p::bindings
