// Watching another process of this host for its exit, through a pidfd (Linux 5.3 and later).
#pragma once

#include <poll.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>

namespace p2p {

// A pidfd of process `pid`, or -1 with errno set (ESRCH: it is gone already).
inline int open_pidfd(pid_t pid) {
#ifdef SYS_pidfd_open
  return static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
#else
  errno = ENOSYS;
  return -1;
#endif
}

// Whether the process behind `pidfd` has exited; does not wait.
inline bool exited(int pidfd) {
  pollfd fd{pidfd, POLLIN, 0};
  return ::poll(&fd, 1, 0) > 0;
}

}  // namespace p2p
