#include "routes/host_cma/route.h"

#include <sys/prctl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <thread>

#include "common/log.h"
#include "common/wire.h"

namespace p2p::cma {

using engine::Peer;
using engine::RemoteRegion;
using engine::Transfer;

namespace {

enum : uint8_t { kAsk = 1, kAnswer = 2 };

// Yama's ptrace_scope, or 0 where Yama is absent.
int ptrace_scope() {
  std::ifstream in("/proc/sys/kernel/yama/ptrace_scope");
  int scope = 0;
  return in >> scope ? scope : 0;
}

// What a handle must say of a region for its owner to know it: size, access, and every rail's
// address and key. A handle whose digest differs from the owner's is refused, as the
// fabric's NICs refuse its RMA.
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

Route::Route(engine::RouteHost& host, uint8_t id, const engine::Config& config, std::string host_id)
    : host_(host), id_(id), host_id_(std::move(host_id)),
      engine_memory_(config.cuda_device < 0 && config.data_path != engine::DataPath::Staged) {
  if (!config.cma || host_id_.empty()) return;
  const int scope = ptrace_scope();
  if (scope >= 2) {
    P2P_LOG(Warn, "the same-host host-memory route (cma) is off: kernel.yama.ptrace_scope is ", scope,
            " (0 or 1 lets processes of one user copy each other's memory); host memory takes the fabric");
    return;
  }
  // Scope 1 lets only ancestors attach: peers on this host may, with this consent.
  if (scope == 1 && prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0) != 0) {
    P2P_LOG(Warn, "the same-host host-memory route (cma) is off: prctl(PR_SET_PTRACER): ", std::strerror(errno));
    return;
  }
  size_t threads = config.cma_threads >= 0 ? static_cast<size_t>(config.cma_threads) : 0;
  if (config.cma_threads < 0) {
    // A quarter of the worker's node, up to 4; below 8 cores none: the worker copies itself,
    // since spare threads would only contend with it and the peer for the few cores.
    const size_t cores = config.node_cpus.empty() ? std::thread::hardware_concurrency() : config.node_cpus.size();
    threads = cores < 8 ? 0 : std::min<size_t>(cores / 4, 4);
  }
  copies_ = std::make_unique<Copies>(threads, [&host] { host.wake(); });
  on_ = true;
}

Route::~Route() { stop(); }

bool Route::reaches(const engine::EngineAddress& a, const RemoteRegion* region) {
  return engine_memory_ && peer_reaches(a, region);
}

bool Route::peer_reaches(const engine::EngineAddress& a, const RemoteRegion* region) const {
  if (!on_ || a.host != host_id_ || !(a.routes & (1u << id_)) || denied_.count(a.incarnation)) return false;
  return !region || (region->device_type == 0 && !region->staged);
}

bool Route::take(Transfer& t) {
  if (t.kind == engine::TransferKind::Message || t.cuda_event || !peer_reaches(t.peer->address, nullptr))
    return false;
  for (const auto& r : t.local)  // staged: data_path="staged" asked for the slots
    if (r->cuda_device >= 0 || r->staged) return false;
  for (const auto& r : t.remote)
    if (!peer_reaches(t.peer->address, r.get())) return false;
  Peer& p = *t.peer;
  ++t.pending;  // until the copy ends
  host_.started(t, id_);
  if (try_start(t)) return true;
  for (const auto& r : t.remote) {
    Grant& g = grants_[key_of(p.incarnation, *r)];
    if (g.asked) continue;
    g.asked = true;
    ByteWriter w;
    w.put(kAsk);
    w.put(r->id);
    w.put(std::get<2>(key_of(p.incarnation, *r)));
    host_.send(p, id_, std::move(w.str()));
  }
  waiting_[p.incarnation].push_back(&t);
  return true;
}

bool Route::try_start(Transfer& t) {
  Peer& p = *t.peer;
  for (const auto& r : t.remote) {
    auto it = grants_.find(key_of(p.incarnation, *r));
    if (it == grants_.end() || !it->second.answered) return false;
  }
  if (t.reported()) {  // failed while it waited
    host_.done(t, {});
    return true;
  }
  std::vector<Span> spans;
  if (Status s = spans_of(t, spans); !s.ok()) {
    host_.done(t, s);
    return true;
  }
  if (t.state != engine::TransferState::Running) t.enter(engine::TransferState::Running);
  host_.watch_process(p);
  copying_[copies_->submit(static_cast<pid_t>(p.address.pid), std::move(spans),
                           t.kind == engine::TransferKind::Write)] = &t;
  return true;
}

// The call's runs and pages as spans, each checked against the owner's answer.
Status Route::spans_of(const Transfer& t, std::vector<Span>& spans) const {
  const bool write = t.kind == engine::TransferKind::Write;
  std::vector<const Grant*> grants;
  for (const auto& r : t.remote) {
    const Grant& g = grants_.at(key_of(t.peer->incarnation, *r));
    if (!g.refused.ok()) return g.refused;
    if (digest(r->nbytes, r->access, r->base, r->key) != g.digest)
      return Status::error(ErrorKind::Remote, cat("the handle of region ", r->id, " of peer ", hex(t.peer->incarnation),
                                                  " does not match its owner's registration"));
    const uint8_t need = write ? engine::kRemoteWrite : engine::kRemoteRead;
    if (!(g.access & need))
      return Status::error(ErrorKind::Remote, cat("region ", r->id, " of peer ", hex(t.peer->incarnation),
                                                  " does not accept remote ", write ? "writes" : "reads",
                                                  " (its owner says)"));
    grants.push_back(&g);
  }
  auto add = [&](uint8_t* local, uint32_t rreg, uint64_t remote, uint64_t len) {
    const Grant& g = *grants[rreg];
    if (!inside(remote, len, g.nbytes)) return false;
    spans.push_back({local, g.ptr + remote, len});
    return true;
  };
  bool ok = true;
  for (const engine::Run& run : t.runs) ok &= add(reinterpret_cast<uint8_t*>(run.local), run.rreg, run.remote, run.len);
  for (const engine::PageRuns& pr : t.pages) {
    const int64_t* lids = t.page_ids.data() + pr.first;
    const int64_t* rids = lids + pr.n;
    for (size_t i = 0; i < pr.n; ++i)
      ok &= add(reinterpret_cast<uint8_t*>(pr.local + lids[i] * pr.local_stride), pr.rreg,
                pr.remote + rids[i] * pr.remote_stride, pr.bytes);
  }
  if (!ok)
    return Status::error(ErrorKind::Remote, cat("a run lies outside its region of peer ", hex(t.peer->incarnation),
                                                " (its owner's registration)"));
  return Status{};
}

bool Route::poll() {
  if (!copies_) return false;
  copies_->poll(ended_);
  for (const Outcome& o : ended_) {
    auto it = copying_.find(o.ticket);
    Transfer& t = *it->second;
    copying_.erase(it);
    Peer& p = *t.peer;
    if (o.error == 0) {
      host_.done(t, {});
    } else if (o.error == ESRCH) {
      Status dead = Status::error(ErrorKind::Peer, cat("peer ", hex(p.incarnation), " is dead: its process (pid ",
                                                       p.address.pid, ") exited"));
      if (!p.failed()) host_.fail_peer(p, dead);
      host_.done(t, dead);
    } else {
      host_.done(t, Status::error(ErrorKind::Remote, cat("copying the memory of peer ", hex(p.incarnation),
                                                         " failed: ", std::strerror(o.error))));
    }
  }
  return !ended_.empty();
}

void Route::on_message(Peer& p, std::string_view body) {
  ByteReader r(body, "cma message");
  const uint8_t kind = r.get<uint8_t>();
  const uint64_t region = r.get<uint64_t>();
  const uint64_t key = r.get<uint64_t>();
  if (kind == kAsk) {
    r.expect_end();
    return answer(p, region, key);
  }
  if (kind != kAnswer) r.fail("unknown kind");
  Grant g;
  g.asked = g.answered = true;
  g.ptr = r.get<uint64_t>();
  g.nbytes = r.get<uint64_t>();
  g.access = r.get<uint8_t>();
  g.digest = r.get<uint32_t>();
  const uint8_t refused = r.get<uint8_t>();
  if (!is_error_kind(refused)) r.fail("bad status");
  g.refused = {static_cast<ErrorKind>(refused), std::string(r.get_bytes(1024))};
  r.expect_end();
  on_grant(p, region, key, std::move(g));
}

// Owner side: the truth about region `region`, if `key` is its key.
void Route::answer(Peer& p, uint64_t region, uint64_t key) {
  const std::shared_ptr<engine::Region> r = host_.region(region);
  Status refused;
  if (!on_)
    refused = Status::error(ErrorKind::Remote, "the owner's cma route is off");
  else if (!r)
    refused = Status::error(ErrorKind::Closed, cat("region ", region, " of peer was deregistered by its owner"));
  else if (r->cuda_device >= 0 || r->staged || r->mrs.empty() || r->mrs[0].key != key)
    refused = Status::error(ErrorKind::Remote, cat("the owner refused region ", region, ": not a host region with that key"));
  const bool ok = refused.ok();
  if (ok) granted_[region].insert(p.incarnation);
  ByteWriter w;
  w.put(kAnswer);
  w.put(region);
  w.put(key);
  w.put<uint64_t>(ok ? reinterpret_cast<uint64_t>(r->ptr) : 0);
  w.put<uint64_t>(ok ? r->nbytes : 0);
  w.put<uint8_t>(ok ? r->access : 0);
  uint32_t known = 0;
  if (ok) {
    std::vector<uint64_t> base, keys;
    for (const auto& mr : r->mrs) {
      base.push_back(mr.base);
      keys.push_back(mr.key);
    }
    known = digest(r->nbytes, r->access, base, keys);
  }
  w.put(known);
  w.put(static_cast<uint8_t>(refused.kind));
  w.put_bytes(refused.message);
  host_.send(p, id_, std::move(w.str()));
}

void Route::on_grant(Peer& p, uint64_t region, uint64_t key, Grant grant) {
  auto it = grants_.find({p.incarnation, region, key});
  if (it == grants_.end() || it->second.answered) return;  // released meanwhile, or not asked
  if (grant.refused.ok() && !tried_.count(p.incarnation) && grant.nbytes > 0) {
    // Whether the OS lets us at the peer's memory at all: one byte, read and dropped.
    tried_.insert(p.incarnation);
    uint8_t byte;
    iovec local{&byte, 1}, remote{reinterpret_cast<void*>(grant.ptr), 1};
    if (process_vm_readv(static_cast<pid_t>(p.address.pid), &local, 1, &remote, 1, 0) != 1 && errno != ESRCH) {
      denied_[p.incarnation] = std::strerror(errno);
      P2P_LOG(Warn, "the cma route to peer ", hex(p.incarnation), " (pid ", p.address.pid,
              ") is not allowed: ", denied_[p.incarnation], "; its host-memory transfers take the fabric");
    }
  }
  it->second = std::move(grant);
  resume(p);
}

void Route::resume(Peer& p) {
  auto w = waiting_.find(p.incarnation);
  if (w == waiting_.end()) return;
  std::vector<Transfer*> still;
  for (Transfer* t : w->second) {
    if (denied_.count(p.incarnation) && t->reported()) {
      host_.done(*t, {});
    } else if (denied_.count(p.incarnation)) {
      --t->pending;
      t->route = engine::TransferRoute::Direct;
      host_.fall_back(*t);
    } else if (!try_start(*t)) {
      still.push_back(t);
    }
  }
  if (still.empty())
    waiting_.erase(p.incarnation);
  else
    w->second = std::move(still);
}

void Route::peer_failed(Peer& p) {
  if (auto w = waiting_.find(p.incarnation); w != waiting_.end()) {
    std::vector<Transfer*> failed = std::move(w->second);
    waiting_.erase(w);
    for (Transfer* t : failed) host_.done(*t, p.failure);
  }
  for (auto it = grants_.lower_bound({p.incarnation, 0, 0}); it != grants_.end() && std::get<0>(it->first) == p.incarnation;)
    it = grants_.erase(it);
  for (auto& [region, peers] : granted_) peers.erase(p.incarnation);
}

void Route::release(uint64_t peer, uint64_t region) {
  for (auto it = grants_.lower_bound({peer, region, 0});
       it != grants_.end() && std::get<0>(it->first) == peer && std::get<1>(it->first) == region;)
    it = grants_.erase(it);
}

bool Route::must_release(const engine::Region& region, const Peer& p) {
  auto it = granted_.find(region.id);
  if (it == granted_.end()) return false;
  const bool granted = it->second.erase(p.incarnation) > 0;
  if (it->second.empty()) granted_.erase(it);
  return granted;
}

}  // namespace p2p::cma
