// Descriptors: an owner's shared-memory files, handed to a same-host peer over a Unix socket
// (SCM_RIGHTS), so that the peer maps them with no access to the owner's process at all (no
// ptrace permission, no Yama consent).
//
// Each engine whose cma route maps listens on the abstract Unix socket named from its
// incarnation. The owner pushes: before it answers a peer's ask for a region held in a
// shared-memory file, it connects to the peer's socket, checks that the listener is that peer's
// process (SO_PEERCRED: its pid, our uid), sends the region's id with the descriptor and
// closes. The answer follows on the control channel, so the descriptor is queued before the
// answer arrives: the initiator, given the answer, accepts what is queued, keeps what came from
// processes of our uid by their pid (SO_PEERCRED), and takes the answering peer's descriptor for
// the region. Nothing waits: every socket is non-blocking, and anything missing or refused
// leaves the region unmapped (the kernel copies it).
//
// A process of the same user may bind a peer's name first or connect to ours: the pid checks
// keep its descriptors from being taken for a peer's, and ours from reaching it.
//
// Owned by the cma route: worker thread only.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace p2p::cma {

class Descriptors {
 public:
  Descriptors() = default;
  Descriptors(const Descriptors&) = delete;
  Descriptors& operator=(const Descriptors&) = delete;
  ~Descriptors();

  // Listens as engine `incarnation`; false (errno) where it cannot.
  bool listen(uint64_t incarnation);
  // Owner side: passes `fd`, the file of region `region`, to engine `incarnation` in process
  // `pid`; "" once it is queued there, else why not.
  std::string push(uint64_t incarnation, pid_t pid, uint64_t region, int fd) const;
  // Initiator side: the descriptor of `region` that process `pid` passed, now the caller's; -1
  // where none came.
  int take(pid_t pid, uint64_t region);
  // Closes what process `pid` passed and nobody took (it failed).
  void forget(pid_t pid);

 private:
  // Accepts every queued connection and receives what each sent.
  void accept_all();
  // Files the descriptor that connection s sent; false (s kept) where nothing came yet: a push
  // may be caught between its connect and its send.
  bool receive(int s);

  int listener_ = -1;
  std::vector<int> connected_;  // accepted, nothing received yet
  std::map<std::pair<pid_t, uint64_t>, int> received_;  // by (process, region)
};

}  // namespace p2p::cma
