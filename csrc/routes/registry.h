// The route registry: every route of csrc/routes/ that implements core/route.h, in the order the
// worker offers transfers to them. A route's index here is its id on the wire (its messages,
// its bit in the engine address), so the order only grows at the end, before the fabric route:
// that one is last, takes whatever the others decline, and its index is on no wire.
//
// A new route: its own folder under csrc/routes/ implementing Route, its settings in
// core/config.h, and one line in make_routes().
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/route.h"

namespace p2p::routes {

std::vector<std::unique_ptr<core::Route>> make_routes(core::RouteHost& host, const core::Config& config,
                                                        const std::string& host_id);

}  // namespace p2p::routes
