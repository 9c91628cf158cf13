#include "core/peer.h"

#include <unistd.h>

#include <algorithm>

namespace p2p::core {

bool Peer::region_gone(uint64_t id) const {
  if (closed_regions.count(id)) return true;
  if (id > live_regions_upto) return false;  // registered after it introduced itself
  return std::none_of(live_regions.begin(), live_regions.end(),
                      [&](auto& range) { return range.first <= id && id <= range.second; });
}

void Peer::forget() {
  partial.clear();
  unacked.clear();
  if (pidfd >= 0) {
    close(pidfd);
    pidfd = -1;
  }
}

}  // namespace p2p::core
