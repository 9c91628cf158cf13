#include "routes/host_cma/descriptors.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>

#include "common/error.h"

namespace p2p::cma {

namespace {

// Beyond these, what no answer takes (a same-user process flooding us) is dropped.
constexpr size_t kMaxReceived = 4096, kMaxConnected = 256;

// The abstract name of engine `incarnation`'s socket, and its length.
socklen_t address_of(uint64_t incarnation, sockaddr_un& addr) {
  addr = {};
  addr.sun_family = AF_UNIX;
  const int n = std::snprintf(addr.sun_path + 1, sizeof addr.sun_path - 1, "torch_p2p.cma.%016llx",
                              static_cast<unsigned long long>(incarnation));
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
}

// What one push carries: the region's id, with the descriptor beside it.
struct Message {
  uint64_t region = 0;
  iovec body{&region, sizeof region};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};

  Message() {
    msg.msg_iov = &body;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
  }
  Message(const Message&) = delete;
};

bool peer_of(int socket, ucred& cred) {
  socklen_t len = sizeof cred;
  return getsockopt(socket, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0;
}

}  // namespace

Descriptors::~Descriptors() {
  for (auto& [key, fd] : received_) close(fd);
  for (int s : connected_) close(s);
  if (listener_ >= 0) close(listener_);
}

bool Descriptors::listen(uint64_t incarnation) {
  const int s = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (s < 0) return false;
  sockaddr_un addr;
  const socklen_t len = address_of(incarnation, addr);
  if (bind(s, reinterpret_cast<sockaddr*>(&addr), len) != 0 || ::listen(s, SOMAXCONN) != 0) {
    const int error = errno;
    close(s);
    errno = error;
    return false;
  }
  listener_ = s;
  return true;
}

std::string Descriptors::push(uint64_t incarnation, pid_t pid, uint64_t region, int fd) const {
  const int s = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (s < 0) return cat("socket: ", std::strerror(errno));
  std::string why;
  sockaddr_un addr;
  const socklen_t len = address_of(incarnation, addr);
  ucred cred{};
  if (connect(s, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    why = cat("connect: ", std::strerror(errno));
  } else if (!peer_of(s, cred)) {
    why = cat("SO_PEERCRED: ", std::strerror(errno));
  } else if (cred.pid != pid || cred.uid != geteuid()) {
    why = cat("its socket belongs to process ", cred.pid, " (uid ", cred.uid, ")");
  } else {
    Message m;
    m.region = region;
    cmsghdr* c = CMSG_FIRSTHDR(&m.msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof fd);
    if (sendmsg(s, &m.msg, MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof region))
      why = cat("sendmsg: ", std::strerror(errno));
  }
  close(s);
  return why;
}

int Descriptors::take(pid_t pid, uint64_t region) {
  accept_all();
  auto it = received_.find({pid, region});
  if (it == received_.end()) return -1;
  const int fd = it->second;
  received_.erase(it);
  return fd;
}

void Descriptors::forget(pid_t pid) {
  for (auto it = received_.lower_bound({pid, 0}); it != received_.end() && it->first.first == pid;) {
    close(it->second);
    it = received_.erase(it);
  }
}

void Descriptors::accept_all() {
  if (listener_ < 0) return;
  for (;;) {
    const int s = accept4(listener_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (s >= 0) connected_.push_back(s);
    else if (errno != EINTR && errno != ECONNABORTED) break;  // EAGAIN: nothing more is queued
  }
  connected_.erase(std::remove_if(connected_.begin(), connected_.end(), [this](int s) { return receive(s); }),
                   connected_.end());
  while (connected_.size() > kMaxConnected) {  // silent connections of other processes
    close(connected_.front());
    connected_.erase(connected_.begin());
  }
}

bool Descriptors::receive(int s) {
  Message m;
  msghdr& msg = m.msg;
  const ssize_t n = recvmsg(s, &msg, MSG_CMSG_CLOEXEC);
  if (n < 0 && (errno == EAGAIN || errno == EINTR)) return false;  // connected, not sent yet
  ucred cred{};
  const bool known = peer_of(s, cred);
  close(s);
  int fd = -1;
  for (cmsghdr* c = n > 0 ? CMSG_FIRSTHDR(&msg) : nullptr; c; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int got;
      std::memcpy(&got, CMSG_DATA(c) + i * sizeof(int), sizeof got);
      if (fd < 0) fd = got;
      else close(got);
    }
  }
  if (fd < 0) return true;
  if (n != static_cast<ssize_t>(sizeof m.region) || (msg.msg_flags & MSG_CTRUNC) || !known || cred.uid != geteuid() ||
      received_.size() >= kMaxReceived) {
    close(fd);
    return true;
  }
  auto [it, added] = received_.try_emplace({cred.pid, m.region}, fd);
  if (!added) {  // the region asked again: the newer descriptor
    close(it->second);
    it->second = fd;
  }
  return true;
}

}  // namespace p2p::cma
