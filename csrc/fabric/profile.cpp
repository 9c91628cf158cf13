#include "fabric/profile.h"

#include <algorithm>

namespace p2p::fabric {

const std::vector<Profile>& profiles() {
  // name, rank, remote, rdma, dmabuf, auto_progress, rails_from_cores, max_chunk, unchecked_fast_rma,
  // cuda_ipc_rma, own_endpoint_names, peers_must_release, target_progress, shares_own_endpoints, known_problem
  static const std::vector<Profile> table = {
      {"efa", 1, true, true, true, false, false, 0, false, false, false, false, false, false, nullptr},
      {"verbs", 2, true, true, true, false, false, 0, false, false, false, false, false, false, nullptr},
      {"tcp", 3, true, false, false, true, true, 0, false, false, false, false, false, false, nullptr},
      {"shm", 0, false, false, false, false, false, 64 << 20, true, true, true, true, true, true,
       "libfabric 1.17's shm can wedge when a peer is killed with transfers in flight, and cannot "
       "cancel an operation that a stopped peer has not served: a call failed after the peer froze "
       "may still move bytes when it resumes"},
  };
  return table;
}

const Profile& profile(std::string_view provider) {
  static const Profile none{"", 0, true, false, false, false, false, 0, false, false, false, false, false, false, nullptr};
  const std::string_view first = provider.substr(0, provider.find(';'));
  for (const Profile& p : profiles())
    if (first == p.name) return p;
  return none;
}

std::vector<const char*> default_providers() {
  std::vector<const Profile*> ranked;
  for (const Profile& p : profiles())
    if (p.default_rank > 0) ranked.push_back(&p);
  std::sort(ranked.begin(), ranked.end(), [](auto* a, auto* b) { return a->default_rank < b->default_rank; });
  std::vector<const char*> names;
  for (const Profile* p : ranked) names.push_back(p->name);
  return names;
}

}  // namespace p2p::fabric
