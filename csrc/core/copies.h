// Copies: moves byte runs between this process and another one on the same host, either with
// cross-memory attach (process_vm_readv / process_vm_writev: the kernel copies, one system
// call per 1024 runs or 1 GiB, with no buffer in between) or, where the other process's memory
// is mapped into this one (a shared-memory file), with memcpy. Small copies run at once on the
// caller's thread; larger ones are cut into shards that a few threads copy side by side. The
// cma route keeps one (routes/host_cma/), and lends it to the staged route's host hop
// (PeerCopies, core/route.h).
//
// Thread model: submit() and poll() on the worker thread; the threads only run shards and
// put finished tickets where poll() finds them, waking the worker through `wake`.
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace p2p::core {

// One contiguous run: `local` in this process, `remote` in the other (or, for a mapped copy,
// where the other's memory is mapped in this one).
struct Span {
  uint8_t* local;
  uint64_t remote;
  uint64_t len;
};

// How a copy ended: errno 0 when every byte moved.
struct Outcome {
  uint64_t ticket = 0;
  int error = 0;
};

// Copies spans[0, n) between this process and `pid`; write: from local to remote. Returns
// errno, 0 on success; a short copy (the other side's memory ended) is EFAULT.
int copy_spans(pid_t pid, const Span* spans, size_t n, bool write);
// The same where the remote ends are mapped into this process: memcpy, which cannot fail (0).
int copy_mapped(const Span* spans, size_t n, bool write);

class Copies {
 public:
  // threads: how many copy threads (0: every copy runs on the caller's thread).
  Copies(size_t threads, std::function<void()> wake);
  ~Copies();  // waits for the shards in flight
  Copies(const Copies&) = delete;
  Copies& operator=(const Copies&) = delete;

  // Starts copying `spans`; the ticket's Outcome comes from poll(). Copies up to kInlineBytes
  // (or all of them without threads) are done before submit() returns. mapped: the spans'
  // remote ends lie in mappings of this process that `mapped` keeps until the copy ends, and
  // memcpy moves them (pid unused).
  uint64_t submit(pid_t pid, std::vector<Span> spans, bool write, std::shared_ptr<const void> mapped = {});
  // The copies that ended since the last call, in any order.
  void poll(std::vector<Outcome>& out);
  bool ended() const;  // some copy's Outcome waits for poll()

  static constexpr uint64_t kInlineBytes = 256 << 10;
  static constexpr uint64_t kShardBytes = 1 << 20;  // no shard is smaller, but the last
  // memcpy has no system call to amortize: a mapped copy spreads over the threads sooner.
  static constexpr uint64_t kMappedInlineBytes = 64 << 10;
  static constexpr uint64_t kMappedShardBytes = 256 << 10;

 private:
  struct Copy {
    uint64_t ticket;
    pid_t pid;
    bool write;
    std::vector<Span> spans;
    size_t shards_left;
    std::shared_ptr<const void> mapped;
    int error = 0;
  };
  struct Shard {
    Copy* copy;
    size_t first, n;  // spans[first, first + n)
  };
  void run();
  void finish(Copy& c);  // under mu_

  std::function<void()> wake_;
  mutable std::mutex mu_;
  std::condition_variable work_;
  std::deque<Shard> shards_;
  std::vector<std::unique_ptr<Copy>> copies_;  // in flight
  std::vector<Outcome> ended_;
  bool stopping_ = false;
  uint64_t last_ticket_ = 0;
  std::vector<std::thread> threads_;
};

}  // namespace p2p::core
