#include "routes/cuda_ipc/route.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/log.h"
#include "common/wire.h"

namespace p2p::ipc {

using core::EngineAddress;
using core::Peer;
using core::RemoteRegion;
using core::Transfer;

namespace {

enum : uint8_t { kAsk = 1, kAnswer = 2 };
// An answer lists its allocations' sizes as (size, count) runs (an expandable segment's are all
// alike): this many fit a route message.
constexpr uint32_t kMaxSizeRuns = 256, kMaxChunks = 1 << 16;

// A refusal the transfer ends with (the region was closed, its handle lies); any other sends
// the transfer to the next route.
bool fails_transfer(const Status& refused) {
  return refused.kind == ErrorKind::Closed || refused.kind == ErrorKind::Value;
}

}  // namespace

Route::Route(core::RouteHost& host, uint8_t id, const core::Config& config, std::string host_id)
    : host_(host), id_(id), host_id_(std::move(host_id)) {
  if (config.cuda_device < 0 || !config.ipc) return;
  if (host_id_.empty()) {
    P2P_LOG(Warn, "CUDA IPC is off: this host's identity (/proc/sys/kernel/random/boot_id) is unknown");
    return;
  }
#ifdef WITH_CUDA  // a build without CUDA has no memory to share: the route stays off
  try {
    if (auto memory = cuda::make_ipc_memory(config.cuda_device, config.ipc_copy_engine_bytes))
      mappings_ = std::make_unique<Mappings>(std::move(memory));
  } catch (const Error& e) {
    P2P_LOG(Warn, "CUDA IPC is off: ", e.what());
  }
#endif
}

Route::~Route() { stop(); }

void Route::stop() {
  copies_.clear();
  waiting_.clear();
  mappings_.reset();  // waits for its copies, then unmaps
}

bool Route::peer_reaches(const EngineAddress& a) const {
  return mappings_ && (a.routes & (1u << id_)) && a.host == host_id_ && !unreachable_.count(a.incarnation);
}

IpcExport Route::export_of(const RemoteRegion& region) const {
  auto it = region.route_bytes.find(id_);
  return IpcExport::decode(it == region.route_bytes.end() ? nullptr : &it->second, region.device_type);
}

bool Route::asks(const EngineAddress& a, const IpcExport& x) const {
  return x.shared.kind == cuda::Export::Vmm && a.pid != static_cast<uint32_t>(getpid());
}

bool Route::map(const EngineAddress& a, const RemoteRegion& region, const IpcExport& x) {
  try {
    mappings_->map(a.incarnation, a.pid == static_cast<uint32_t>(getpid()), region, x);
    return true;
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::Value) throw;
    unreachable_[a.incarnation] = e.what();
    P2P_LOG(Warn, "CUDA IPC to peer ", hex(a.incarnation), " is not possible (", e.what(),
            "): its transfers take the fabric");
    return false;
  }
}

// A VMM region of another process is mapped at its first transfer: until then it is reached
// unless its owner refused it.
bool Route::reaches(const EngineAddress& a, const RemoteRegion* region) {
  if (!peer_reaches(a)) return false;
  if (!region) return true;
  if (region->incarnation != a.incarnation) return false;
  try {
    const IpcExport x = export_of(*region);
    if (x.shared.kind == cuda::Export::None) return false;
    if (asks(a, x)) return !refused_.count({a.incarnation, region->id});
    return map(a, *region, x);
  } catch (const Error&) {  // a handle that lies about its memory: its transfers fail
    return false;
  }
}

void Route::describe(core::Region& region, RemoteRegion& handle) {
  if (!mappings_ || region.cuda_device < 0) return;
  std::string why;
  IpcExport x;
  x.shared = mappings_->export_storage(region.ptr, region.nbytes, why);
  x.ptr = reinterpret_cast<uint64_t>(region.ptr);
  if (x.shared.kind == cuda::Export::None) {
    P2P_LOG(Info, "region ", region.id, " is not exported for CUDA IPC (", why,
            "): same-host peers reach it as other hosts do");
    return;
  }
  handle.route_bytes[id_] = x.encode();
}

// Takes t if both ends are CUDA memory of this host and every remote region maps (VMM regions
// of another process: once their owner answers).
bool Route::take(Transfer& t) {
  if (t.kind == core::TransferKind::Message || !peer_reaches(t.peer->address)) return false;
  for (const auto& r : t.local)
    if (r->cuda_device < 0) return false;
  Peer& p = *t.peer;
  std::vector<uint64_t> ask;  // VMM regions neither mapped nor asked for
  bool wait = false;
  try {
    for (const auto& r : t.remote) {
      const IpcExport x = export_of(*r);
      if (x.shared.kind == cuda::Export::None) return false;
      if (!asks(p.address, x)) {
        if (!map(p.address, *r, x)) return false;
        continue;
      }
      const RegionKey key{p.incarnation, r->id};
      if (mappings_->mapped(key.first, key.second)) continue;
      if (auto no = refused_.find(key); no != refused_.end()) {
        if (!fails_transfer(no->second)) return false;
        throw Error(no->second.kind, no->second.message);
      }
      wait = true;
      if (!asked_.count(key) && std::find(ask.begin(), ask.end(), r->id) == ask.end()) ask.push_back(r->id);
    }
  } catch (const Error& e) {  // a handle that lies about its memory, or a region closed
    ++t.pending;
    host_.done(t, Status::error(e.kind(), e.what()));
    return true;
  }
  if (wait && !listening_) {  // before our first ask: owners pass descriptors before they answer
    listening_ = descriptors_.listen(host_.incarnation());
    if (!listening_) {
      const Status no = Status::error(ErrorKind::Remote, cat("listening for descriptors: ", std::strerror(errno)));
      P2P_LOG(Warn, "CUDA IPC cannot map peers' VMM memory (", no.message, "): transfers to it take the next route");
      for (uint64_t region : ask) refused_[{p.incarnation, region}] = no;
      return false;
    }
  }
  ++t.pending;  // until the copy is done
  if (!wait) {
    start(t);
    host_.started(t, id_);
    return true;
  }
  waiting_[p.incarnation].push_back(&t);
  host_.started(t, id_);  // its stream order is its future while it waits (stream_order)
  for (uint64_t region : ask) {
    asked_.insert({p.incarnation, region});
    ByteWriter w;
    w.put(kAsk);
    w.put(region);
    host_.send(p, id_, std::move(w.str()));
  }
  return true;
}

void Route::start(Transfer& t) {
  Peer& p = *t.peer;
  host_.watch_process(p);
  std::vector<const RemoteRegion*> regions;
  for (const auto& r : t.remote) regions.push_back(r.get());
  const uint64_t ticket = mappings_->copy(p.incarnation, regions, t.runs, t.pages, t.page_ids,
                                          t.kind == core::TransferKind::Write, t.cuda_event);
  t.enter(core::TransferState::Running);
  copies_.push_back({ticket, &t});
}

// A stream that follows an IPC copy waits for an event recorded after it: on the GPU only, so
// nothing it holds up can hold up the copy (a wait on a flag the host releases could). A
// transfer still waiting for its owner's answer has no copy yet: its future says when it ends.
core::StreamOrder Route::stream_order(const Transfer& t) {
  if (auto w = waiting_.find(t.peer->incarnation); w != waiting_.end())
    if (std::find(w->second.begin(), w->second.end(), &t) != w->second.end()) return {core::StreamOrder::Future};
  if (void* event = mappings_->mark()) return {core::StreamOrder::Event, event};
  return {core::StreamOrder::Future};
}

// Sends out the copies queued since the last turn in one launch, completes the transfers whose
// copies are done (in the order they were queued) and unmaps what was released.
bool Route::poll() {
  if (!mappings_) return false;
  mappings_->flush();
  mappings_->poll();
  size_t n = 0;
  while (n < copies_.size() && mappings_->done(copies_[n].first)) ++n;
  if (n == 0) return false;
  std::vector<std::pair<uint64_t, Transfer*>> ended(copies_.begin(), copies_.begin() + n);
  copies_.erase(copies_.begin(), copies_.begin() + n);
  for (auto& [ticket, t] : ended) {
    const std::string error = mappings_->error(ticket);
    host_.done(*t, error.empty() ? Status{}
                                 : Status::error(ErrorKind::Generic, cat("the CUDA IPC copy failed: ", error)));
  }
  return true;
}

void Route::on_message(Peer& p, std::string_view body) {
  ByteReader r(body, "ipc message");
  const uint8_t kind = r.get<uint8_t>();
  const uint64_t region = r.get<uint64_t>();
  if (kind == kAsk) {
    r.expect_end();
    return answer(p, region);
  }
  if (kind != kAnswer) r.fail("unknown kind");
  const uint8_t refused = r.get<uint8_t>();
  if (!is_error_kind(refused)) r.fail("bad status");
  Status status{static_cast<ErrorKind>(refused), std::string(r.get_bytes(1024))};
  const uint32_t runs = r.get<uint32_t>();
  if (runs > kMaxSizeRuns) r.fail("too many allocations");
  std::vector<uint64_t> sizes;
  for (uint32_t i = 0; i < runs; ++i) {
    const uint64_t size = r.get<uint64_t>();
    const uint32_t count = r.get<uint32_t>();
    if (size == 0 || count > kMaxChunks - sizes.size()) r.fail("bad allocation sizes");
    sizes.insert(sizes.end(), count, size);
  }
  r.expect_end();
  if (status.ok() == sizes.empty()) r.fail("an answer with neither allocations nor a reason");
  answered(p, region, std::move(status), std::move(sizes));
}

void Route::answer(Peer& p, uint64_t region) {
  Status refused;
  std::vector<std::pair<uint64_t, uint32_t>> runs;  // (size, count)
  const std::shared_ptr<core::Region> r = host_.region(region);
  if (!mappings_ || !peer_reaches(p.address)) {
    refused = Status::error(ErrorKind::Remote, "the owner's IPC route does not reach the asking engine");
  } else if (!r) {
    refused = Status::error(ErrorKind::Closed, cat("region ", region, " of peer was deregistered by its owner"));
  } else if (r->cuda_device < 0) {
    refused = Status::error(ErrorKind::Remote, cat("region ", region, " is not CUDA memory"));
  } else {
    std::string why;
    std::vector<cuda::VmmChunk> chunks = mappings_->export_vmm(reinterpret_cast<uint64_t>(r->ptr), r->nbytes, why);
    std::vector<int> fds;
    for (const cuda::VmmChunk& c : chunks) {
      fds.push_back(c.fd);
      if (runs.empty() || runs.back().first != c.size) runs.push_back({c.size, 0});
      ++runs.back().second;
    }
    if (chunks.empty()) why = cat("exporting its CUDA VMM allocations failed: ", why);
    else if (runs.size() > kMaxSizeRuns) why = cat("its ", chunks.size(), " allocations have too many sizes for an answer");
    else if (why = descriptors_.push(p.incarnation, static_cast<pid_t>(p.address.pid), region, fds); !why.empty())
      why = cat("passing its allocations' descriptors failed: ", why);
    for (int fd : fds) close(fd);  // the peer has its own now
    if (!why.empty()) {
      refused = Status::error(ErrorKind::Remote, why);
      runs.clear();
      P2P_LOG(Info, "region ", region, " is not mapped by peer ", hex(p.incarnation), " over CUDA IPC: ", why);
    }
  }
  ByteWriter w;
  w.put(kAnswer);
  w.put(region);
  w.put(static_cast<uint8_t>(refused.kind));
  w.put_bytes(refused.message);
  w.put(static_cast<uint32_t>(runs.size()));
  for (auto [size, count] : runs) {
    w.put(size);
    w.put(count);
  }
  host_.send(p, id_, std::move(w.str()));
}

void Route::answered(Peer& p, uint64_t region, Status refused, std::vector<uint64_t> sizes) {
  const RegionKey key{p.incarnation, region};
  std::vector<int> fds = refused.ok() ? descriptors_.take(static_cast<pid_t>(p.address.pid), region) : std::vector<int>{};
  if (!asked_.erase(key)) {  // released meanwhile: nothing waits for it
    for (int fd : fds) close(fd);
    return;
  }
  // The handle of the region as a waiting transfer names it.
  const RemoteRegion* handle = nullptr;
  if (auto w = waiting_.find(p.incarnation); w != waiting_.end())
    for (Transfer* t : w->second)
      for (const auto& r : t->remote)
        if (r->id == region && !handle) handle = r.get();
  if (refused.ok() && (fds.size() != sizes.size() || !handle))
    refused = Status::error(ErrorKind::Remote, handle ? "its allocations' descriptors did not come (the owner logs why)"
                                                      : "no transfer waits for it");
  if (refused.ok()) {
    std::vector<cuda::VmmChunk> chunks;
    for (size_t i = 0; i < sizes.size(); ++i) chunks.push_back({0, sizes[i], fds[i]});
    fds.clear();
    try {
      mappings_->map_vmm(p.incarnation, *handle, export_of(*handle), chunks);
      P2P_LOG(Debug, "mapped VMM region ", region, " of peer ", hex(p.incarnation), " (", sizes.size(), " allocations)");
    } catch (const Error& e) {
      refused = Status::error(e.kind() == ErrorKind::Value ? ErrorKind::Value : ErrorKind::Remote, e.what());
    }
  }
  for (int fd : fds) close(fd);
  if (!refused.ok()) {
    P2P_LOG(Warn, "CUDA IPC cannot map VMM region ", region, " of peer ", hex(p.incarnation), " (", refused.message, "): ",
            fails_transfer(refused) ? "its transfers fail" : "its transfers take the next route");
    refused_[key] = refused;
  }
  // Resumes the transfers that waited for it: those with every region mapped start, those with
  // one refused end or move on, the rest wait on.
  auto w = waiting_.find(p.incarnation);
  if (w == waiting_.end()) return;
  std::vector<Transfer*> waiting = std::move(w->second);
  waiting_.erase(w);
  std::vector<Transfer*> still;
  for (Transfer* t : waiting) {
    const Status* no = nullptr;
    bool ready = true;
    for (const auto& r : t->remote) {
      const RegionKey k{p.incarnation, r->id};
      if (auto it = refused_.find(k); it != refused_.end()) no = &it->second;
      else if (asked_.count(k)) ready = false;
    }
    if (t->reported()) {  // failed while it waited
      host_.done(*t, {});
    } else if (no && fails_transfer(*no)) {
      host_.done(*t, *no);
    } else if (no) {
      --t->pending;
      host_.pass_on(*t);
    } else if (ready) {
      start(*t);
    } else {
      still.push_back(t);
    }
  }
  if (!still.empty()) waiting_[p.incarnation] = std::move(still);
}

void Route::peer_failed(Peer& p) {
  if (auto w = waiting_.find(p.incarnation); w != waiting_.end()) {
    std::vector<Transfer*> failed = std::move(w->second);
    waiting_.erase(w);
    for (Transfer* t : failed) host_.done(*t, p.failure);
  }
  asked_.erase(asked_.lower_bound({p.incarnation, 0}), asked_.upper_bound({p.incarnation, UINT64_MAX}));
  refused_.erase(refused_.lower_bound({p.incarnation, 0}), refused_.upper_bound({p.incarnation, UINT64_MAX}));
  descriptors_.forget(static_cast<pid_t>(p.address.pid));
  if (mappings_) mappings_->forget(p.incarnation);  // once the copies queued for it are done
}

void Route::release(uint64_t peer, uint64_t region) {
  asked_.erase({peer, region});
  refused_.erase({peer, region});
  if (mappings_) mappings_->release(peer, region);
}

// IPC copies check nothing at our end: a peer that may have the region mapped must let go first.
bool Route::must_release(const core::Region& region, const Peer& p) {
  return region.cuda_device >= 0 && peer_reaches(p.address);
}

}  // namespace p2p::ipc
