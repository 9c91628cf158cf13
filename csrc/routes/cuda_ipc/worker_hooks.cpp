// The worker's side of the IPC route: deciding which transfers take it, completing them, and
// watching the processes of the peers it maps (csrc/routes/cuda_ipc/route.h says how the route works).
#include <poll.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/log.h"
#include "core/host.h"
#include "engine/worker.h"

namespace p2p::engine {

void Worker::open_ipc() {
  host_ = host_identity();
  if (config_.cuda_device < 0 || !config_.ipc) return;
  if (host_.empty()) {
    P2P_LOG(Warn, "CUDA IPC is off: this host's identity (/proc/sys/kernel/random/boot_id) is unknown");
    return;
  }
  try {
    if (auto memory = ipc::make_memory(config_.cuda_device, config_.ipc_copy_engine_bytes))
      ipc_ = std::make_unique<ipc::Route>(std::move(memory));
  } catch (const Error& e) {
    P2P_LOG(Warn, "CUDA IPC is off: ", e.what());
  }
}

bool Worker::ipc_reaches(const EngineAddress& a) const {
  return ipc_ && a.cuda_ipc && a.host == host_ && !no_ipc_.count(a.incarnation);
}

// Takes t onto the IPC route if both ends are CUDA memory of this host; false leaves it to the
// fabric. A mapping that fails sends the peer's transfers to the fabric from then on, said once.
bool Worker::start_ipc(Transfer& t) {
  if (t.kind == TransferKind::Message || !ipc_reaches(t.peer->address)) return false;
  for (const auto& r : t.local)
    if (r->cuda_device < 0) return false;
  for (const auto& r : t.remote)
    if (!r->ipc.exported()) return false;
  Peer& p = *t.peer;
  try {
    for (const auto& r : t.remote) ipc_->map(p.incarnation, p.address.pid == static_cast<uint32_t>(getpid()), *r);
  } catch (const Error& e) {
    if (e.kind() == ErrorKind::Value) {  // a handle that lies about its memory
      fail(t, Status::error(ErrorKind::Value, e.what()));
      return true;
    }
    no_ipc_[p.incarnation] = e.what();
    P2P_LOG(Warn, "CUDA IPC to peer ", hex(p.incarnation), " is not possible (", e.what(),
            "): its transfers take the fabric (", region_staged(true) ? "staged" : "direct", ")");
    return false;
  }
  watch_process(p);
  std::vector<const RemoteRegion*> regions;
  for (const auto& r : t.remote) regions.push_back(r.get());
  const uint64_t ticket =
      ipc_->copy(p.incarnation, regions, t.runs, t.pages, t.page_ids, t.kind == TransferKind::Write, t.cuda_event);
  t.route = TransferRoute::Ipc;
  t.enter(TransferState::Running);
  ++t.pending;
  ipc_copies_.push_back({ticket, t.id});
  answer_orders(t);
  return true;
}

// Completes the transfers whose copies are done, in the order they were queued.
bool Worker::poll_ipc() {
  if (!ipc_) return false;
  ipc_->poll();
  size_t n = 0;
  while (n < ipc_copies_.size() && ipc_->done(ipc_copies_[n].first)) ++n;
  if (n == 0) return false;
  for (size_t i = 0; i < n; ++i) {
    const std::string error = ipc_->error(ipc_copies_[i].first);
    auto it = transfers_.find(ipc_copies_[i].second);
    if (it != transfers_.end())
      transfer_op_done(*it->second, error.empty() ? Status{}
                                                  : Status::error(ErrorKind::Generic, cat("the CUDA IPC copy failed: ", error)));
  }
  ipc_copies_.erase(ipc_copies_.begin(), ipc_copies_.begin() + n);
  return true;
}

// A stream that follows an IPC copy waits for an event recorded after it: on the GPU only, so
// nothing it holds up can hold up the copy. A wait on a flag the host releases could (README,
// "stream_wait"): seen on the GPU machine.
StreamOrder Worker::order_of(const Transfer& t) {
  if (t.reported()) return {};
  if (t.route == TransferRoute::Ipc)
    if (void* event = ipc_->mark()) return {StreamOrder::Event, event};
  return {StreamOrder::Future};
}

void Worker::stream_order(uint64_t id, StreamOrderAnswer answer) {
  auto it = transfers_.find(id);
  // Not a transfer (a notification, a receive), or one that ended: its future says when.
  if (it == transfers_.end()) return answer->set_value({StreamOrder::Future});
  const Transfer& t = *it->second;
  if (t.state == TransferState::WaitingForPeer) {  // no route yet
    order_waits_[id].push_back(std::move(answer));
    return;
  }
  answer->set_value(order_of(t));
}

void Worker::answer_orders(const Transfer& t) {
  if (order_waits_.empty()) return;
  auto it = order_waits_.find(t.id);
  if (it == order_waits_.end()) return;
  for (auto& answer : it->second) answer->set_value(order_of(t));  // an event each: each is recycled
  order_waits_.erase(it);
}

std::string Worker::route(const std::string& address, const RemoteRegion* region) {
  const EngineAddress a = EngineAddress::decode(address);
  const bool cuda = config_.cuda_device >= 0;
  if (cuda && ipc_reaches(a) && (!region || (region->ipc.exported() && region->owner == address))) {
    if (!region) return "ipc";
    try {
      ipc_->map(a.incarnation, a.pid == static_cast<uint32_t>(getpid()), *region);
      return "ipc";
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::Value) {
        no_ipc_[a.incarnation] = e.what();
        P2P_LOG(Warn, "CUDA IPC to peer ", hex(a.incarnation), " is not possible (", e.what(), ")");
      }
    }
  }
  if (!cuda && config_.data_path != DataPath::Staged)
    for (auto& r : routes_)
      if (r->reaches(a, region)) return r->name();
  return region_staged(cuda) || (region && region->staged) ? "staged" : "direct";
}

// A peer whose memory we map is watched through a pidfd: its exit fails its transfers at once,
// where the fabric would only notice its silence (IPC copies need nothing from the peer).
void Worker::watch_process(Peer& p) {
  if (p.pidfd >= 0 || p.address.pid == 0 || p.address.pid == static_cast<uint32_t>(getpid())) return;
#ifdef SYS_pidfd_open
  p.pidfd = static_cast<int>(syscall(SYS_pidfd_open, static_cast<pid_t>(p.address.pid), 0));
  if (p.pidfd < 0) P2P_LOG(Info, "cannot watch the process of peer ", hex(p.incarnation), ": ", std::strerror(errno));
#endif
}

void Worker::check_processes() {
  std::vector<Peer*> exited;
  for (auto& [inc, p] : peers_) {
    if (p->pidfd < 0 || p->failed()) continue;
    pollfd fd{p->pidfd, POLLIN, 0};
    if (::poll(&fd, 1, 0) > 0) exited.push_back(p.get());
  }
  for (Peer* p : exited)
    fail_peer(*p, Status::error(ErrorKind::Peer, cat("peer ", hex(p->incarnation), " is dead: its process (pid ",
                                                     p->address.pid, ") exited")));
}

}  // namespace p2p::engine
