#include "core/grants.h"

#include <memory>
#include <string>

#include "common/wire.h"

namespace p2p::core {

namespace {

enum : uint8_t { kAsk = 1, kAnswer = 2 };  // Grants::carries

// What a handle must say of a region for its owner to know it: size, access, and every rail's
// base and key. A handle whose digest differs from the owner's is refused, as the fabric's
// NICs refuse its RMA.
uint32_t digest(uint64_t nbytes, uint8_t access, const std::vector<uint64_t>& base, const std::vector<uint64_t>& key) {
  ByteWriter w;
  w.put(nbytes);
  w.put(access);
  for (size_t i = 0; i < base.size() && i < key.size(); ++i) {
    w.put(base[i]);
    w.put(key[i]);
  }
  return crc32(w.str().data(), w.str().size());
}

// Whether [offset, offset + len) lies in nbytes, without overflow.
bool inside(uint64_t offset, uint64_t len, uint64_t nbytes) { return offset <= nbytes && len <= nbytes - offset; }

}  // namespace

bool Grants::answered(const Transfer& t) const {
  for (const auto& r : t.remote) {
    auto it = grants_.find(key_of(t.peer->incarnation, *r));
    if (it == grants_.end() || !it->second.answered) return false;
  }
  return true;
}

void Grants::wait(Transfer& t) {
  Peer& p = *t.peer;
  for (const auto& r : t.remote) {
    const Key k = key_of(p.incarnation, *r);
    if (!grants_.try_emplace(k).second) continue;  // asked already, for this or an earlier transfer
    ByteWriter w;
    w.put(kAsk);
    w.put(r->id);
    w.put(std::get<2>(k));
    host_.send(p, route_, std::move(w.str()));
  }
  waiting_[p.incarnation].push_back(&t);
}

Status Grants::check(const Transfer& t) {
  const uint64_t peer = t.peer->incarnation;
  return check(t, peer, [&](const RemoteRegion& r) -> const Grant* {
    auto it = grants_.find(key_of(peer, r));
    return it == grants_.end() ? nullptr : &it->second;
  }, call_);
}

Status Grants::check(const TransferCall& t, uint64_t peer, const Find& find, std::vector<const Grant*>& call) {
  const bool write = t.kind == TransferKind::Write;
  call.clear();
  for (const auto& r : t.remote) {
    const Grant* found = find(*r);
    if (!found)
      return Status::error(ErrorKind::Closed, cat("region ", r->id, " of peer ", hex(peer), " was released"));
    const Grant& g = *found;
    if (!g.refused.ok()) return g.refused;
    if (digest(r->nbytes, r->access, r->base, r->key) != g.digest)
      return Status::error(ErrorKind::Remote, cat("the handle of region ", r->id, " of peer ", hex(peer),
                                                  " does not match its owner's registration"));
    const uint8_t need = write ? kRemoteWrite : kRemoteRead;
    if (!(g.access & need))
      return Status::error(ErrorKind::Remote, cat("region ", r->id, " of peer ", hex(peer), " does not accept remote ",
                                                  write ? "writes" : "reads", " (its owner says)"));
    call.push_back(&g);
  }
  if (!runs(t, [&](uint8_t*, uint32_t rreg, uint64_t remote, uint64_t len) {
        return rreg < call.size() && inside(remote, len, call[rreg]->nbytes);
      }))
    return Status::error(ErrorKind::Remote,
                         cat("a run lies outside its region of peer ", hex(peer), " (its owner's registration)"));
  return Status{};
}

Grants::Grant* Grants::on_message(Peer& p, std::string_view body) {
  ByteReader r(body, what_);
  const uint8_t kind = r.get<uint8_t>();
  const uint64_t region = r.get<uint64_t>();
  const uint64_t key = r.get<uint64_t>();
  if (kind == kAsk) {
    r.expect_end();
    answer(p, region, key);
    return nullptr;
  }
  if (kind != kAnswer) r.fail("unknown kind");
  Grant g;
  g.answered = true;
  g.region = region;
  g.key = key;
  g.ptr = r.get<uint64_t>();
  g.nbytes = r.get<uint64_t>();
  g.access = r.get<uint8_t>();
  g.digest = r.get<uint32_t>();
  g.extra = std::string(r.get_bytes(kExtraBytes));
  const uint8_t refused = r.get<uint8_t>();
  if (!is_error_kind(refused)) r.fail("bad status");
  g.refused = {static_cast<ErrorKind>(refused), std::string(r.get_bytes(1024))};
  r.expect_end();
  auto it = grants_.find({p.incarnation, region, key});
  if (it == grants_.end() || it->second.answered) return nullptr;  // released meanwhile, or not asked
  it->second = std::move(g);
  return &it->second;
}

void Grants::answer(Peer& p, uint64_t region, uint64_t key) {
  const std::shared_ptr<Region> r = host_.region(region);
  Status refused = refusal_(p);
  if (refused.ok() && !r)
    refused = Status::error(ErrorKind::Closed, cat("region ", region, " of peer was deregistered by its owner"));
  else if (refused.ok() && (r->cuda_device >= 0 || !r->on_nics() || r->mrs[0].key != key))
    refused = Status::error(ErrorKind::Remote, cat("the owner refused region ", region, ": not a host region with that key"));
  const bool ok = refused.ok();
  if (ok) granted_[region].insert(p.incarnation);
  const std::string extra = ok && granting_ ? granting_(p, *r) : std::string();
  uint32_t known = 0;
  if (ok) {
    std::vector<uint64_t> base, keys;
    for (const auto& mr : r->mrs) {
      base.push_back(mr.base);
      keys.push_back(mr.key);
    }
    known = digest(r->nbytes, r->access, base, keys);
  }
  ByteWriter w;
  w.put(kAnswer);
  w.put(region);
  w.put(key);
  w.put<uint64_t>(ok ? reinterpret_cast<uint64_t>(r->ptr) : 0);
  w.put<uint64_t>(ok ? r->nbytes : 0);
  w.put<uint8_t>(ok ? r->access : 0);
  w.put(known);
  w.put_bytes(extra);
  w.put(static_cast<uint8_t>(refused.kind));
  w.put_bytes(refused.message);
  host_.send(p, route_, std::move(w.str()));
}

void Grants::peer_failed(Peer& p) {
  if (auto w = waiting_.find(p.incarnation); w != waiting_.end()) {
    std::vector<Transfer*> failed = std::move(w->second);
    waiting_.erase(w);
    for (Transfer* t : failed) host_.done(*t, p.failure);
  }
  for (auto it = grants_.lower_bound({p.incarnation, 0, 0}); it != grants_.end() && std::get<0>(it->first) == p.incarnation;)
    it = grants_.erase(it);
  for (auto& [region, peers] : granted_) peers.erase(p.incarnation);
}

void Grants::release(uint64_t peer, uint64_t region) {
  for (auto it = grants_.lower_bound({peer, region, 0});
       it != grants_.end() && std::get<0>(it->first) == peer && std::get<1>(it->first) == region;)
    it = grants_.erase(it);
}

bool Grants::must_release(const Region& region, const Peer& p) {
  auto it = granted_.find(region.id);
  if (it == granted_.end()) return false;
  const bool granted = it->second.erase(p.incarnation) > 0;
  if (it->second.empty()) granted_.erase(it);
  return granted;
}

}  // namespace p2p::core
