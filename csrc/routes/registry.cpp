#include "routes/registry.h"

#include "routes/cuda_ipc/route.h"
#include "routes/fabric/route.h"
#include "routes/host_cma/route.h"
#include "routes/loopback/route.h"
#include "routes/staged/route.h"

namespace p2p::routes {

std::vector<std::unique_ptr<core::Route>> make_routes(core::RouteHost& host, const core::Config& config,
                                                        const std::string& host_id) {
  std::vector<std::unique_ptr<core::Route>> routes;
  routes.push_back(std::make_unique<ipc::Route>(host, 0, config, host_id));
  auto cma = std::make_unique<cma::Route>(host, 1, config, host_id);
  core::PeerCopies* same_host = cma.get();  // the staged route's host hop, where it reaches
  routes.push_back(std::move(cma));
  routes.push_back(std::make_unique<staged::Route>(host, 2, same_host));
  routes.push_back(std::make_unique<loopback::Route>(host, 3, config, host_id));  // tests only
  routes.push_back(std::make_unique<fabric::Route>(host, 4));  // last: takes what the others decline
  return routes;
}

}  // namespace p2p::routes
