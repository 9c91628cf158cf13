// Mailbox: the commands Python threads queue for the worker (commands.h), and the worker's
// sleep, which a command, a rail thread or a route ends (wake()).
//
// Thread: post() and wake() from any thread; the rest on the worker thread.
#pragma once

#include <atomic>
#include <mutex>
#include <vector>

#include "engine/commands.h"

namespace p2p::engine {

using namespace core;

class Mailbox {
 public:
  Mailbox();  // the wake eventfd and the epoll set the worker sleeps on
  ~Mailbox();
  Mailbox(const Mailbox&) = delete;
  Mailbox& operator=(const Mailbox&) = delete;

  // Queues a command. Throws ClosedError once close() ran.
  void post(Command command);
  // Ends the worker's sleep, if it sleeps; ring() ends the next one too.
  void wake();
  void ring();
  // Moves the queued commands into `batch` (empty before); false if there were none.
  bool take(std::vector<Command>& batch);
  // No command is accepted from now on; returns those still queued.
  std::vector<Command> close();

  int wake_fd() const { return wake_fd_; }
  std::atomic<bool>* sleeping() { return &sleeping_; }
  void watch(int fd);  // a wait fd that ends a sleep too
  // Sleeps up to timeout_ms unless `may_sleep` says otherwise once sleeping is announced
  // (so that a wake() racing with the decision is not lost). fds: whether the watched fds
  // cover every source of events; else a short nap.
  template <typename MaySleep>
  void sleep(bool fds, int timeout_ms, const MaySleep& may_sleep);

 private:
  bool queued();
  void doze(bool fds, int timeout_ms);

  std::mutex mu_;
  std::vector<Command> commands_;
  bool closed_ = false;  // under mu_
  std::atomic<bool> sleeping_{false};
  int wake_fd_ = -1;  // eventfd
  int epoll_fd_ = -1;
};

template <typename MaySleep>
void Mailbox::sleep(bool fds, int timeout_ms, const MaySleep& may_sleep) {
  sleeping_.store(true, std::memory_order_release);
  if (!queued() && may_sleep()) doze(fds, timeout_ms);
  sleeping_.store(false, std::memory_order_release);
}

}  // namespace p2p::engine
