#include "core/region_table.h"

#include <algorithm>

namespace p2p::core {

bool RegionTable::close(uint64_t id, Waiter done, double deadline) {
  auto it = live_.find(id);
  if (it == live_.end()) {
    // Closing already (an earlier close() gave up waiting): wait for the same end.
    for (auto& c : closing_)
      if (c.region->id == id) {
        c.waiters.push_back(std::move(done));
        return false;
      }
    done->set_value();
    return false;
  }
  it->second->closing = true;
  closing_.push_back({std::move(it->second), {std::move(done)}, {}, deadline});
  live_.erase(it);
  return true;
}

void RegionTable::must_release(uint64_t id, uint64_t peer) {
  for (auto& c : closing_)
    if (c.region->id == id) c.unreleased.insert(peer);
}

void RegionTable::released(uint64_t id, uint64_t peer) {
  for (auto& c : closing_)
    if (c.region->id == id) c.unreleased.erase(peer);
}

void RegionTable::forget_peer(uint64_t peer) {
  for (auto& c : closing_) c.unreleased.erase(peer);
}

void RegionTable::finish(double now, const Deregister& deregister) {
  for (size_t i = 0; i < closing_.size();) {
    Closing& c = closing_[i];
    if (c.region.use_count() > 1 || (!c.unreleased.empty() && now < c.deadline)) {
      ++i;
      continue;
    }
    deregister(*c.region);
    for (auto& done : c.waiters) done->set_value();
    closing_.erase(closing_.begin() + i);
  }
}

void RegionTable::clear(const Deregister& deregister) {
  for (auto& c : closing_)
    for (auto& done : c.waiters) done->set_value();
  closing_.clear();
  for (auto& [id, region] : live_) deregister(*region);
  live_.clear();
}

LiveRegions RegionTable::live() const {
  std::vector<uint64_t> ids;
  for (const auto& [id, r] : live_) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  LiveRegions live;
  for (uint64_t id : ids) {
    if (!live.ranges.empty() && live.ranges.back().second + 1 == id) live.ranges.back().second = id;
    else live.ranges.push_back({id, id});
  }
  constexpr size_t kMaxRanges = 256;  // keeps the introduction one message
  if (live.ranges.size() > kMaxRanges) return {};  // too scattered to list: the peer checks nothing
  live.upto = last_id_;
  return live;
}

}  // namespace p2p::core
