// The cma route's copies, lent to another route's host hop (PeerCopies, core/route.h): the
// staged route moves its slots' bytes with them between processes of one host. A lent copy
// runs on the route's own Copies, and ends through its poll() with the failures of its own
// copies (route.cpp, Route::outcome).
#include <sys/uio.h>

#include <cerrno>
#include <cstring>

#include "common/log.h"
#include "routes/host_cma/route.h"

namespace p2p::cma {

using core::Peer;

bool Route::reaches(const Peer& p) const {
  return copies_ && peer_reaches(p.address, nullptr) && !denied_.count(p.incarnation);
}

bool Route::allowed(Peer& p, uint64_t addr) {
  if (tried_.insert(p.incarnation).second) {
    // One byte, read and dropped. A peer that is gone fails its copies later, as any.
    uint8_t byte;
    iovec local{&byte, 1}, remote{reinterpret_cast<void*>(addr), 1};
    if (process_vm_readv(static_cast<pid_t>(p.address.pid), &local, 1, &remote, 1, 0) != 1 && errno != ESRCH) {
      denied_[p.incarnation] = std::strerror(errno);
      P2P_LOG(Warn, "the cma route to peer ", hex(p.incarnation), " (pid ", p.address.pid, ") is not allowed: ",
              denied_[p.incarnation], "; its host memory that is not mapped and its staged host hops take the fabric",
              scope_ == 1 ? " (kernel.yama.ptrace_scope 1: a process consents to one peer; tensors in shared memory, "
                            "share_memory_() before register, need no consent, and TORCH_P2P_CMA_PTRACE=any in the "
                            "peer lets every process of its user copy its memory)"
                          : "");
    } else {
      P2P_LOG(Info, "the cma route reaches peer ", hex(p.incarnation), " (pid ", p.address.pid, ")");
    }
  }
  return !denied_.count(p.incarnation);
}

void Route::copy(Peer& p, std::vector<Span> spans, bool write, core::CopyOwner& owner) {
  host_.watch_process(p);
  lent_[copies_->submit(static_cast<pid_t>(p.address.pid), std::move(spans), write)] = {&p, &owner};
}

}  // namespace p2p::cma
