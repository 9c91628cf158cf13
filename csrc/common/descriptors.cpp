#include "common/descriptors.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>

#include "common/error.h"

namespace p2p {

namespace {

// Beyond these, what no answer takes (a same-user process flooding us) is dropped.
constexpr size_t kMaxReceived = 4096, kMaxConnected = 256;
// Descriptors per message (the kernel takes up to 253, SCM_MAX_FD), and per tag.
constexpr uint32_t kBatch = 128, kMaxPerTag = 1 << 16;

// The abstract name of engine `incarnation`'s socket for `route`, and its length.
socklen_t address_of(const char* route, uint64_t incarnation, sockaddr_un& addr) {
  addr = {};
  addr.sun_family = AF_UNIX;
  const int n = std::snprintf(addr.sun_path + 1, sizeof addr.sun_path - 1, "torch_p2p.%s.%016llx", route,
                              static_cast<unsigned long long>(incarnation));
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
}

// What one push message carries: the tag and where its descriptors go among the tag's, with
// the descriptors beside it. A push of more than kBatch is several connections, in order.
struct Message {
  struct Header {
    uint64_t tag = 0;
    uint32_t first = 0, total = 0;
  } header;
  iovec body{&header, sizeof header};
  alignas(cmsghdr) char control[CMSG_SPACE(kBatch * sizeof(int))] = {};
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
  for (auto& [key, r] : received_)
    for (int fd : r.fds)
      if (fd >= 0) close(fd);
  for (int s : connected_) close(s);
  if (listener_ >= 0) close(listener_);
}

bool Descriptors::listen(uint64_t incarnation) {
  const int s = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (s < 0) return false;
  sockaddr_un addr;
  const socklen_t len = address_of(route_, incarnation, addr);
  if (bind(s, reinterpret_cast<sockaddr*>(&addr), len) != 0 || ::listen(s, SOMAXCONN) != 0) {
    const int error = errno;
    close(s);
    errno = error;
    return false;
  }
  listener_ = s;
  return true;
}

std::string Descriptors::push(uint64_t incarnation, pid_t pid, uint64_t tag, const std::vector<int>& fds) const {
  if (fds.empty() || fds.size() > kMaxPerTag) return cat(fds.size(), " descriptors to pass");
  sockaddr_un addr;
  const socklen_t len = address_of(route_, incarnation, addr);
  for (size_t first = 0; first < fds.size(); first += kBatch) {
    const int s = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (s < 0) return cat("socket: ", std::strerror(errno));
    std::string why;
    ucred cred{};
    if (connect(s, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
      why = cat("connect: ", std::strerror(errno));
    } else if (!peer_of(s, cred)) {
      why = cat("SO_PEERCRED: ", std::strerror(errno));
    } else if (cred.pid != pid || cred.uid != geteuid()) {
      why = cat("its socket belongs to process ", cred.pid, " (uid ", cred.uid, ")");
    } else {
      const size_t n = std::min<size_t>(kBatch, fds.size() - first);
      Message m;
      m.header = {tag, static_cast<uint32_t>(first), static_cast<uint32_t>(fds.size())};
      m.msg.msg_controllen = CMSG_SPACE(n * sizeof(int));
      cmsghdr* c = CMSG_FIRSTHDR(&m.msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(n * sizeof(int));
      std::memcpy(CMSG_DATA(c), fds.data() + first, n * sizeof(int));
      if (sendmsg(s, &m.msg, MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof m.header))
        why = cat("sendmsg: ", std::strerror(errno));
    }
    close(s);
    if (!why.empty()) return why;
  }
  return {};
}

std::vector<int> Descriptors::take(pid_t pid, uint64_t tag) {
  accept_all();
  auto it = received_.find({pid, tag});
  if (it == received_.end()) return {};
  Received r = std::move(it->second);
  received_.erase(it);
  if (r.missing == 0) return std::move(r.fds);
  for (int fd : r.fds)
    if (fd >= 0) close(fd);
  return {};
}

void Descriptors::forget(pid_t pid) {
  for (auto it = received_.lower_bound({pid, 0}); it != received_.end() && it->first.first == pid;) {
    for (int fd : it->second.fds)
      if (fd >= 0) close(fd);
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
  std::vector<int> got;
  for (cmsghdr* c = n > 0 ? CMSG_FIRSTHDR(&msg) : nullptr; c; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
      got.push_back(fd);
    }
  }
  auto drop = [&] {
    for (int fd : got) close(fd);
    return true;
  };
  if (got.empty()) return true;
  const Message::Header& h = m.header;
  if (n != static_cast<ssize_t>(sizeof h) || (msg.msg_flags & MSG_CTRUNC) || !known || cred.uid != geteuid() ||
      h.total == 0 || h.total > kMaxPerTag || h.first >= h.total || got.size() > h.total - h.first)
    return drop();
  auto it = received_.find({cred.pid, h.tag});
  if (it == received_.end()) {
    if (received_.size() >= kMaxReceived) return drop();
    it = received_.emplace(std::make_pair(cred.pid, h.tag), Received{}).first;
  }
  Received& r = it->second;
  if (h.first == 0 || r.fds.size() != h.total) {  // a new push for the tag (asked again): the newer
    for (int fd : r.fds)
      if (fd >= 0) close(fd);
    r.fds.assign(h.total, -1);
    r.missing = h.total;
  }
  for (size_t i = 0; i < got.size(); ++i) {
    int& slot = r.fds[h.first + i];
    if (slot >= 0) close(slot);
    else --r.missing;
    slot = got[i];
  }
  return true;
}

}  // namespace p2p
