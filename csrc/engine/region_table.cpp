#include "engine/region_table.h"

#include <algorithm>

namespace p2p::engine {

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

void RegionTable::put_live(ByteWriter& w) const {
  std::vector<uint64_t> live;
  for (const auto& [id, r] : live_) live.push_back(id);
  std::sort(live.begin(), live.end());
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (uint64_t id : live) {
    if (!ranges.empty() && ranges.back().second + 1 == id) ranges.back().second = id;
    else ranges.push_back({id, id});
  }
  constexpr size_t kMaxRanges = 256;  // keeps the introduction one message
  if (ranges.size() > kMaxRanges) {
    w.put<uint64_t>(0);  // too scattered to list: the peer checks nothing
    w.put<uint16_t>(0);
    return;
  }
  w.put(last_id_);
  w.put(static_cast<uint16_t>(ranges.size()));
  for (auto [first, last] : ranges) {
    w.put(first);
    w.put(last);
  }
}

}  // namespace p2p::engine
