// Descriptors: file descriptors handed from one engine to a same-host peer over a Unix socket
// (SCM_RIGHTS), so that the peer maps the memory behind them with no access to the owner's
// process at all (no ptrace permission, no Yama consent): the cma route's shared-memory files,
// the IPC route's CUDA VMM allocations.
//
// Each engine of a route that takes descriptors listens on the abstract Unix socket named from
// the route and its incarnation. The owner pushes: before it answers a peer's ask, it connects
// to the peer's socket, checks that the listener is that peer's process (SO_PEERCRED: its pid,
// our uid), sends a tag (the region's id) with the descriptors and closes. The answer follows
// on the control channel, so the descriptors are queued before the answer arrives: the
// initiator, given the answer, accepts what is queued, keeps what came from processes of our
// uid by their pid (SO_PEERCRED), and takes the answering peer's descriptors for the tag.
// Nothing waits: every socket is non-blocking, and anything missing or refused leaves the
// memory unmapped (the route says what it does instead).
//
// A process of the same user may bind a peer's name first or connect to ours: the pid checks
// keep its descriptors from being taken for a peer's, and ours from reaching it.
//
// Owned by one route: worker thread only.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace p2p {

class Descriptors {
 public:
  // route: the route's name in the socket's (a literal).
  explicit Descriptors(const char* route) : route_(route) {}
  Descriptors(const Descriptors&) = delete;
  Descriptors& operator=(const Descriptors&) = delete;
  ~Descriptors();

  // Listens as engine `incarnation`; false (errno) where it cannot.
  bool listen(uint64_t incarnation);
  // Owner side: passes `fds` (still the caller's), under `tag`, to engine `incarnation` in
  // process `pid`; "" once they are queued there, else why not.
  std::string push(uint64_t incarnation, pid_t pid, uint64_t tag, const std::vector<int>& fds) const;
  // Initiator side: the descriptors that process `pid` passed under `tag`, now the caller's;
  // empty where they did not all come.
  std::vector<int> take(pid_t pid, uint64_t tag);
  // Closes what process `pid` passed and nobody took (it failed).
  void forget(pid_t pid);

 private:
  struct Received {
    std::vector<int> fds;  // -1 where not come yet
    size_t missing = 0;
  };
  // Accepts every queued connection and receives what each sent.
  void accept_all();
  // Files the descriptors that connection s sent; false (s kept) where nothing came yet: a
  // push may be caught between its connect and its send.
  bool receive(int s);

  const char* const route_;
  int listener_ = -1;
  std::vector<int> connected_;  // accepted, nothing received yet
  std::map<std::pair<pid_t, uint64_t>, Received> received_;  // by (process, tag)
};

}  // namespace p2p
