#include "routes/host_cma/route.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "common/log.h"
#include "common/process.h"
#include "core/caller_copies.h"
#include "routes/host_cma/ptrace_consent.h"

namespace p2p::cma {

using core::Peer;
using core::RemoteRegion;
using core::Transfer;

Route::Route(core::RouteHost& host, uint8_t id, const core::Config& config, std::string host_id)
    : host_(host), id_(id), host_id_(std::move(host_id)),
      engine_memory_(config.cuda_device < 0 && config.data_path != core::DataPath::Staged),
      grants_(
          host, id, "cma message",
          [this](const Peer&) {
            return on_ ? Status{} : Status::error(ErrorKind::Remote, "the owner's cma route is off");
          },
          [this](Peer& p, const core::Region& region) { return granting(p, region); }) {
  if (!config.cma || host_id_.empty()) return;
  scope_ = ptrace_scope();
  if (scope_ >= 2) {
    P2P_LOG(Warn, "the same-host host-memory route (cma) is off: kernel.yama.ptrace_scope is ", scope_,
            " (0 or 1 lets processes of one user copy each other's memory); host memory takes the fabric");
    return;
  }
  // Scope 1 lets only ancestors attach; by default the owner consents to one peer at a time.
  if (scope_ == 1 && config.cma_ptrace == "any" && !consent_to_any()) {
    P2P_LOG(Warn, "the same-host host-memory route (cma) is off: prctl(PR_SET_PTRACER, any): ", std::strerror(errno));
    return;
  }
  size_t threads = config.cma_threads >= 0 ? static_cast<size_t>(config.cma_threads) : 0;
  if (config.cma_threads < 0) {
    // Half the worker's node, up to 8; below 8 cores one per core, so that a large call copies
    // on every core (the worker only hands it out). Large calls are bound by memory bandwidth,
    // which one thread's copies are far from (16 cores: 8 threads moved twice what 4 did).
    const size_t cores = config.node_cpus.empty() ? std::thread::hardware_concurrency() : config.node_cpus.size();
    threads = cores < 8 ? cores : std::min<size_t>(cores / 2, 8);
  }
  copies_ = std::make_unique<Copies>(threads, [&host] { host.wake(); });
  map_ = config.cma_map;
  on_ = true;
}

Route::~Route() { stop(); }

void Route::stop() {
  host_.caller_copies().clear();
  copies_.reset();
}

void Route::learn(core::Region& region, const c10::StorageImpl& storage) {
  if (region.cuda_device < 0) region.keep(id_, SharedFile::of(storage, region.ptr, region.nbytes));
}

bool Route::reaches(const core::EngineAddress& a, const RemoteRegion* region) {
  if (!engine_memory_ || !peer_reaches(a, region)) return false;
  if (!denied_.count(a.incarnation)) return true;
  const core::Grants::Grant* grant = region ? grants_.find(a.incarnation, *region) : nullptr;
  return grant && grant->mapped;
}

bool Route::peer_reaches(const core::EngineAddress& a, const RemoteRegion* region) const {
  if (!on_ || a.host != host_id_ || !(a.routes & (1u << id_))) return false;
  return !region || (region->device_type == 0 && region->on_nics);
}

bool Route::take(Transfer& t) {
  if (t.kind == core::TransferKind::Message || t.cuda_event || !peer_reaches(t.peer->address, nullptr))
    return false;
  for (const auto& r : t.local)  // off the NICs: data_path="staged" asked for the slots
    if (r->cuda_device >= 0 || !r->on_nics()) return false;
  for (const auto& r : t.remote)
    if (!peer_reaches(t.peer->address, r.get())) return false;
  if (map_ && !listening_) {  // before our first ask: owners push descriptors before they answer
    listening_ = true;
    if (!descriptors_.listen(host_.incarnation()))
      P2P_LOG(Info, "the cma route cannot take peers' shared-memory files (listening: ", std::strerror(errno),
              "); the kernel copies them");
  }
  grants_.take(t, [&](Transfer& t) { return try_start(t); });  // until the copy ends
  return true;
}

bool Route::try_start(Transfer& t) {
  if (!grants_.answered(t)) return false;
  if (t.reported()) {  // failed while it waited
    host_.done(t, {});
    return true;
  }
  std::vector<Span> spans;
  const Status s = grants_.resolve(t, [&](uint8_t* local, uint64_t remote, uint64_t len) {
    spans.push_back({local, remote, len});
  });
  if (!s.ok()) {
    host_.done(t, s);
    return true;
  }
  Peer& p = *t.peer;
  std::shared_ptr<const void> mapped = in_mappings(spans);
  if (!mapped && denied_.count(p.incarnation)) {  // the kernel would copy, and the OS refuses it
    --t.pending;
    host_.pass_on(t);
    return true;
  }
  if (t.state != core::TransferState::Running) t.enter(core::TransferState::Running);
  host_.watch_process(p);  // a mapped copy outlives its peer: the process watch fails the transfer
  copying_[copies_->submit(static_cast<pid_t>(p.address.pid), std::move(spans),
                           t.kind == core::TransferKind::Write, std::move(mapped))] = &t;
  return true;
}

std::shared_ptr<const void> Route::in_mappings(std::vector<Span>& spans) const {
  const std::vector<const core::Grants::Grant*>& grants = grants_.resolved();
  for (const auto* g : grants)
    if (!g->mapped) return nullptr;
  for (Span& s : spans) {
    for (const auto* g : grants) {
      if (s.remote - g->ptr >= g->nbytes) continue;  // resolve() put every run inside a region
      s.remote = reinterpret_cast<uint64_t>(g->mapped.get()) + (s.remote - g->ptr);
      break;
    }
  }
  if (grants.size() == 1) return grants[0]->mapped;
  auto all = std::make_shared<std::vector<std::shared_ptr<uint8_t>>>();
  for (const auto* g : grants) all->push_back(g->mapped);
  return all;
}

bool Route::poll() {
  if (!copies_) return false;
  copies_->poll(ended_);
  for (const Outcome& o : ended_) {
    if (auto lent = lent_.find(o.ticket); lent != lent_.end()) {
      auto [p, owner] = lent->second;
      lent_.erase(lent);
      owner->copied(outcome(*p, o.error));
      continue;
    }
    auto it = copying_.find(o.ticket);
    Transfer& t = *it->second;
    copying_.erase(it);
    host_.done(t, outcome(*t.peer, o.error));
  }
  return !ended_.empty();
}

Status Route::outcome(Peer& p, int error) {
  // A copy with a mapping succeeds after its owner died (the file outlives the process): one
  // that ended after the exit did not happen with a live peer.
  if (error == 0 && p.pidfd >= 0 && exited(p.pidfd)) error = ESRCH;
  if (error == 0) return {};
  if (error == ESRCH) {
    Status dead = Status::error(ErrorKind::Peer, cat("peer ", hex(p.incarnation), " is dead: its process (pid ",
                                                     p.address.pid, ") exited"));
    if (!p.failed()) host_.fail_peer(p, dead);
    return dead;
  }
  return Status::error(ErrorKind::Remote,
                       cat("copying the memory of peer ", hex(p.incarnation), " failed: ", std::strerror(error)));
}

void Route::on_message(Peer& p, std::string_view body) {
  core::Grants::Grant* grant = grants_.on_message(p, body);
  if (!grant) return;  // an ask (answered), or nothing new
  if (map_ && grant->refused.ok() && !grant->extra.empty()) map(p, *grant);
  host_.caller_copies().add(p, *grant);  // if mapped
  // Only the kernel's copies need the OS's leave: tried at the first region we do not map.
  if (grant->refused.ok() && grant->nbytes > 0 && !grant->mapped) allowed(p, grant->ptr);
  grants_.resume(p, [&](Transfer& t) { return try_start(t); });
}

void Route::map(const Peer& p, core::Grants::Grant& grant) {
  const pid_t pid = static_cast<pid_t>(p.address.pid);
  const std::optional<SharedFile> file = SharedFile::decode(grant.extra);
  int fd = -1;
  if (file) {
    const std::vector<int> fds = descriptors_.take(pid, grant.region);
    fd = fds.size() == 1 ? fds[0] : -1;
    for (size_t i = fd >= 0 ? 1 : 0; i < fds.size(); ++i) close(fds[i]);  // one file per region
  }
  errno = 0;
  const bool writable = grant.access & core::kRemoteWrite;
  if (fd >= 0) grant.mapped = map_file(fd, *file, grant.nbytes, writable);
  populator_.add(grant.mapped, grant.nbytes, writable);
  if (!logged_maps_.insert(p.incarnation).second) return;
  if (grant.mapped)
    P2P_LOG(Info, "the cma route maps the shared memory of peer ", hex(p.incarnation), " (pid ", p.address.pid, ")");
  else
    P2P_LOG(Info, "the cma route cannot map the shared memory of peer ", hex(p.incarnation), " (pid ", p.address.pid,
            "): ", fd < 0 ? "its descriptor did not come (the owner logs why)" : std::strerror(errno),
            "; the kernel copies it");
}

std::string Route::granting(Peer& p, const core::Region& region) {
  const SharedFile* file = region.state<SharedFile>(id_);
  if (file) {
    const std::string why = descriptors_.push(p.incarnation, static_cast<pid_t>(p.address.pid), region.id, {file->fd});
    if (why.empty()) return file->encode();
    if (logged_pushes_.insert(p.incarnation).second)
      P2P_LOG(Info, "the cma route cannot pass the shared memory of region ", region.id, " to peer ",
              hex(p.incarnation), " (pid ", p.address.pid, "): ", why, "; the peer's kernel copies it");
  }
  consent(p);
  return file ? file->encode() : std::string();
}

bool Route::consent(const Peer& p) {
  if (scope_ != 1) return true;  // 0: none needed (the route is off above 1)
  pid_t holder = 0;
  if (consent_to(static_cast<pid_t>(p.address.pid), holder)) return true;
  if (unconsented_.insert(p.incarnation).second)
    P2P_LOG(Warn, "the cma route cannot let peer ", hex(p.incarnation), " (pid ", p.address.pid,
            ") copy this process's private host memory: kernel.yama.ptrace_scope is 1 and ",
            holder ? cat("the consent (one process) is process ", holder, "'s")
                   : cat("prctl(PR_SET_PTRACER) failed: ", std::strerror(errno)),
            "; that peer's transfers of it take the fabric. Tensors in shared memory (share_memory_() before "
            "register) need no consent; TORCH_P2P_CMA_PTRACE=any lets every process of this user read and "
            "write this one");
  return false;
}

void Route::peer_failed(Peer& p) {
  host_.caller_copies().forget_peer(p.incarnation);
  grants_.peer_failed(p);
  descriptors_.forget(static_cast<pid_t>(p.address.pid));
}

void Route::release(uint64_t peer, uint64_t region) {
  host_.caller_copies().forget(peer, region);  // before the owner hears: no copy of it after
  grants_.release(peer, region);
}

bool Route::must_release(const core::Region& region, const Peer& p) { return grants_.must_release(region, p); }

}  // namespace p2p::cma
