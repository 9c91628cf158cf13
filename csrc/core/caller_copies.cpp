#include "core/caller_copies.h"

#include <unistd.h>

#include <cstring>
#include <vector>

#include "common/counters.h"
#include "common/process.h"
#include "core/peer.h"

namespace p2p::core {

void CallerCopies::add(const Peer& p, const Grants::Grant& grant) {
  if (!on() || !grant.mapped) return;  // a mapped answer is a granting one
  std::lock_guard<std::mutex> lock(mu_);
  Owner& owner = owners_[p.address_bytes];
  if (owner.pidfd < 0) {
    owner.incarnation = p.incarnation;
    owner.pidfd = open_pidfd(static_cast<pid_t>(p.address.pid));
    if (owner.pidfd < 0) {  // gone already, or no pidfds here: its calls stay with the worker
      owners_.erase(p.address_bytes);
      return;
    }
  }
  owner.regions[{grant.region, grant.key}] = grant;
}

template <class Gone>
void CallerCopies::remove(Gone&& gone) {
  std::lock_guard<std::mutex> lock(mu_);  // waits for the copies that found them
  for (auto it = owners_.begin(); it != owners_.end();) {
    if (!gone(it->second)) {
      ++it;
      continue;
    }
    close(it->second.pidfd);
    it = owners_.erase(it);
  }
}

void CallerCopies::forget(uint64_t peer, uint64_t region) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [address, owner] : owners_) {
    if (owner.incarnation != peer) continue;
    for (auto it = owner.regions.begin(); it != owner.regions.end();)
      it = it->first.first == region ? owner.regions.erase(it) : std::next(it);
  }
}

void CallerCopies::forget_peer(uint64_t peer) {
  remove([&](const Owner& o) { return o.incarnation == peer; });
}

void CallerCopies::clear() {
  remove([](const Owner&) { return true; });
}

bool CallerCopies::move(const TransferCall& t) {
  if (!on() || t.kind == TransferKind::Message || t.notify || t.cuda_event) return false;
  // Every host call passes here: a large one is let go as soon as its size says so.
  uint64_t bytes = 0;
  for (const Run& r : t.runs)
    if ((bytes += r.len) > max_bytes_) return false;
  for (const PageRuns& pr : t.pages)
    if ((bytes += pr.bytes * pr.n) > max_bytes_) return false;
  std::lock_guard<std::mutex> lock(mu_);
  auto found = owners_.find(t.peer_address);
  if (found == owners_.end()) return false;
  const Owner& owner = found->second;
  thread_local std::vector<const Grants::Grant*> call;
  const Status checked = Grants::check(t, owner.incarnation, [&](const RemoteRegion& r) -> const Grants::Grant* {
    auto it = owner.regions.find({r.id, Grants::key(r)});
    return it == owner.regions.end() ? nullptr : &it->second;
  }, call);
  if (!checked.ok()) return false;
  const bool write = t.kind == TransferKind::Write;
  Grants::runs(t, [&](uint8_t* local, uint32_t rreg, uint64_t remote, uint64_t len) {
    uint8_t* there = call[rreg]->mapped.get() + remote;
    std::memcpy(write ? there : local, write ? local : there, len);
    return true;
  });
  if (exited(owner.pidfd)) return false;
  count(Counter::CallerCopies);
  return true;
}

}  // namespace p2p::core
