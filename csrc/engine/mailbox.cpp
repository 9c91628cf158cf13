#include "engine/mailbox.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/rail_driver.h"

namespace p2p::engine {

using namespace core;

Mailbox::Mailbox() {
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  P2P_CHECK(wake_fd_ >= 0 && epoll_fd_ >= 0, ErrorKind::Generic, "eventfd/epoll: ", std::strerror(errno));
  watch(wake_fd_);
}

Mailbox::~Mailbox() {
  if (epoll_fd_ >= 0) ::close(epoll_fd_);
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

void Mailbox::post(Command command) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    P2P_CHECK(!closed_, ErrorKind::Closed, "the engine is closed");
    commands_.push_back(std::move(command));
  }
  wake();
}

void Mailbox::wake() {
  if (sleeping_.load(std::memory_order_acquire)) ring();
}

void Mailbox::ring() {
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof one);
}

bool Mailbox::take(std::vector<Command>& batch) {
  std::lock_guard<std::mutex> lock(mu_);
  if (commands_.empty()) return false;
  batch.swap(commands_);  // the queue keeps the emptied buffer: post() need not allocate
  return true;
}

std::vector<Command> Mailbox::close() {
  std::vector<Command> late;
  std::lock_guard<std::mutex> lock(mu_);
  closed_ = true;
  late.swap(commands_);
  return late;
}

bool Mailbox::queued() {
  std::lock_guard<std::mutex> lock(mu_);
  return !commands_.empty();
}

void Mailbox::watch(int fd) {
  epoll_event ev{};
  ev.events = EPOLLIN;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev);
}

void Mailbox::doze(bool fds, int timeout_ms) { p2p::core::doze(fds ? epoll_fd_ : -1, wake_fd_, timeout_ms); }

}  // namespace p2p::engine
