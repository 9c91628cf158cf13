#include "routes/host_cma/route.h"

#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <thread>

#include "common/log.h"
#include "common/process.h"

namespace p2p::cma {

using engine::Peer;
using engine::RemoteRegion;
using engine::Transfer;

namespace {

// Yama's ptrace_scope, or 0 where Yama is absent.
int ptrace_scope() {
  std::ifstream in("/proc/sys/kernel/yama/ptrace_scope");
  int scope = 0;
  return in >> scope ? scope : 0;
}

// The shared-memory file of process `pid` (its descriptor there), mapped into this process
// from the region's byte at `file.offset` for `nbytes`; null with errno set where the OS or the
// file does not allow it, or the descriptor names another file by now. Taking another
// process's descriptor (pidfd_getfd, Linux 5.6) needs the same permission as cross-memory
// attach.
std::shared_ptr<uint8_t> map_file(pid_t pid, const engine::HostFile& file, uint64_t nbytes, bool writable) {
#ifdef SYS_pidfd_getfd
  const int pidfd = open_pidfd(pid);
  if (pidfd < 0) return nullptr;
  const int fd = static_cast<int>(syscall(SYS_pidfd_getfd, pidfd, file.fd, 0));
  close(pidfd);
  if (fd < 0) return nullptr;
  struct stat st {};
  const uint64_t offset = file.offset, page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t start = offset / page * page;
  const size_t len = offset + nbytes - start;
  void* base = MAP_FAILED;
  errno = 0;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || static_cast<uint64_t>(st.st_dev) != file.device ||
      static_cast<uint64_t>(st.st_ino) != file.inode || static_cast<uint64_t>(st.st_size) < offset + nbytes)
    errno = errno ? errno : ESTALE;
  else
    base = mmap(nullptr, len, PROT_READ | (writable ? PROT_WRITE : 0), MAP_SHARED, fd,
                static_cast<off_t>(start));
  close(fd);
  if (base == MAP_FAILED) return nullptr;
  return std::shared_ptr<uint8_t>(static_cast<uint8_t*>(base) + (offset - start), [base, len](uint8_t*) {
    munmap(base, len);
  });
#else
  errno = ENOSYS;
  return nullptr;
#endif
}

}  // namespace

Route::Route(engine::RouteHost& host, uint8_t id, const engine::Config& config, std::string host_id)
    : host_(host), id_(id), host_id_(std::move(host_id)),
      engine_memory_(config.cuda_device < 0 && config.data_path != engine::DataPath::Staged),
      grants_(host, id, "cma message", [this](const Peer&) {
        return on_ ? Status{} : Status::error(ErrorKind::Remote, "the owner's cma route is off");
      }) {
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
  if (t.state != engine::TransferState::Running) t.enter(engine::TransferState::Running);
  host_.watch_process(p);  // a mapped copy outlives its peer: the process watch fails the transfer
  std::shared_ptr<const void> mapped = in_mappings(spans);
  copying_[copies_->submit(static_cast<pid_t>(p.address.pid), std::move(spans),
                           t.kind == engine::TransferKind::Write, std::move(mapped))] = &t;
  return true;
}

std::shared_ptr<const void> Route::in_mappings(std::vector<Span>& spans) const {
  const std::vector<const engine::Grants::Grant*>& grants = grants_.resolved();
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
  engine::Grants::Grant* grant = grants_.on_message(p, body);
  if (!grant) return;  // an ask (answered), or nothing new
  if (grant->refused.ok() && grant->nbytes > 0) allowed(p, grant->ptr);
  const bool denied = denied_.count(p.incarnation) > 0;
  if (!denied && map_ && grant->refused.ok() && grant->file.fd >= 0) map(p, *grant);
  grants_.resume(p, [&](Transfer& t) {
    if (denied && t.reported()) {
      host_.done(t, {});
    } else if (denied) {
      --t.pending;
      host_.pass_on(t);
    } else {
      return try_start(t);
    }
    return true;
  });
}

void Route::map(const Peer& p, engine::Grants::Grant& grant) {
  grant.mapped = map_file(static_cast<pid_t>(p.address.pid), grant.file, grant.nbytes, grant.access & engine::kRemoteWrite);
  if (!logged_maps_.insert(p.incarnation).second) return;
  if (grant.mapped)
    P2P_LOG(Info, "the cma route maps the shared memory of peer ", hex(p.incarnation), " (pid ", p.address.pid, ")");
  else
    P2P_LOG(Info, "the cma route cannot map the shared memory of peer ", hex(p.incarnation), " (pid ",
            p.address.pid, "): ", std::strerror(errno), "; the kernel copies it");
}

void Route::peer_failed(Peer& p) { grants_.peer_failed(p); }

void Route::release(uint64_t peer, uint64_t region) { grants_.release(peer, region); }

bool Route::must_release(const engine::Region& region, const Peer& p) { return grants_.must_release(region, p); }

}  // namespace p2p::cma
