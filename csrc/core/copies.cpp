#include "core/copies.h"

#include <pthread.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>

namespace p2p::core {

int copy_spans(pid_t pid, const Span* spans, size_t n, bool write) {
  constexpr size_t kBatch = IOV_MAX;  // the most iovecs one call takes (1024 on Linux)
  // The kernel moves at most MAX_RW_COUNT (about 2 GiB) a call and returns a short count past
  // it; a call stops short too at the first run it cannot reach. So calls take at most 1 GiB,
  // a short count resumes where it stopped, and a call that moves nothing is the fault.
  constexpr uint64_t kCallBytes = 1ull << 30;
  iovec local[kBatch], remote[kBatch];
  size_t i = 0;
  uint64_t done = 0;  // bytes of spans[i] already moved
  for (;;) {
    while (i < n && spans[i].len == done) {
      ++i;
      done = 0;
    }
    if (i == n) return 0;
    size_t m = 0;
    uint64_t bytes = 0;
    for (size_t k = i; k < n && m < kBatch && bytes < kCallBytes; ++k) {
      const uint64_t skip = k == i ? done : 0;
      const uint64_t len = std::min(spans[k].len - skip, kCallBytes - bytes);
      if (len == 0) continue;
      local[m] = {spans[k].local + skip, len};
      remote[m] = {reinterpret_cast<void*>(spans[k].remote + skip), len};
      bytes += len;
      ++m;
    }
    const ssize_t moved = write ? process_vm_writev(pid, local, m, remote, m, 0)
                                : process_vm_readv(pid, local, m, remote, m, 0);
    if (moved < 0) return errno;
    if (moved == 0) return EFAULT;
    for (uint64_t left = static_cast<uint64_t>(moved); left > 0;) {
      const uint64_t step = std::min(left, spans[i].len - done);
      done += step;
      left -= step;
      if (done == spans[i].len) {
        ++i;
        done = 0;
      }
    }
  }
}

int copy_mapped(const Span* spans, size_t n, bool write) {
  for (size_t i = 0; i < n; ++i) {
    auto* remote = reinterpret_cast<uint8_t*>(spans[i].remote);
    if (write)
      std::memcpy(remote, spans[i].local, spans[i].len);
    else
      std::memcpy(spans[i].local, remote, spans[i].len);
  }
  return 0;
}

Copies::Copies(size_t threads, std::function<void()> wake) : wake_(std::move(wake)) {
  for (size_t i = 0; i < threads; ++i) threads_.emplace_back([this] { run(); });
}

Copies::~Copies() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  work_.notify_all();
  for (auto& t : threads_) t.join();
}

uint64_t Copies::submit(pid_t pid, std::vector<Span> spans, bool write, std::shared_ptr<const void> mapped) {
  uint64_t total = 0;
  for (const Span& s : spans) total += s.len;
  const uint64_t ticket = ++last_ticket_;
  if (threads_.empty() || total <= (mapped ? kMappedInlineBytes : kInlineBytes)) {
    const int error = mapped ? copy_mapped(spans.data(), spans.size(), write)
                             : copy_spans(pid, spans.data(), spans.size(), write);
    std::lock_guard<std::mutex> lock(mu_);
    ended_.push_back({ticket, error});
    return ticket;
  }
  // Shards of about equal bytes, one per thread at most, none below the shard size: a run
  // that crosses a shard's end is cut there.
  const uint64_t shard_bytes = mapped ? kMappedShardBytes : kShardBytes;
  const uint64_t shards = std::clamp<uint64_t>(total / shard_bytes, 1, threads_.size());
  const uint64_t per_shard = (total + shards - 1) / shards;
  auto copy = std::make_unique<Copy>(Copy{ticket, pid, write, {}, 0, std::move(mapped)});
  std::vector<std::pair<size_t, size_t>> ranges;
  uint64_t filled = 0;
  size_t first = 0;
  for (Span s : spans) {
    while (s.len > 0) {
      const uint64_t take = std::min(s.len, per_shard - filled);
      copy->spans.push_back({s.local, s.remote, take});
      s.local += take;
      s.remote += take;
      s.len -= take;
      filled += take;
      if (filled == per_shard) {
        ranges.push_back({first, copy->spans.size() - first});
        first = copy->spans.size();
        filled = 0;
      }
    }
  }
  if (first < copy->spans.size()) ranges.push_back({first, copy->spans.size() - first});
  copy->shards_left = ranges.size();
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto [f, n] : ranges) shards_.push_back({copy.get(), f, n});
    copies_.push_back(std::move(copy));
  }
  work_.notify_all();
  return ticket;
}

void Copies::run() {
  pthread_setname_np(pthread_self(), "p2p-copy");  // counted by the benchmarks' labels
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    work_.wait(lock, [this] { return stopping_ || !shards_.empty(); });
    if (shards_.empty()) return;  // stopping, and nothing left
    const Shard s = shards_.front();
    shards_.pop_front();
    lock.unlock();
    const Span* spans = s.copy->spans.data() + s.first;
    const int error = s.copy->mapped ? copy_mapped(spans, s.n, s.copy->write)
                                     : copy_spans(s.copy->pid, spans, s.n, s.copy->write);
    lock.lock();
    if (error && !s.copy->error) s.copy->error = error;
    if (--s.copy->shards_left == 0) finish(*s.copy);
  }
}

void Copies::finish(Copy& c) {
  ended_.push_back({c.ticket, c.error});
  copies_.erase(std::find_if(copies_.begin(), copies_.end(), [&](auto& p) { return p.get() == &c; }));
  wake_();
}

void Copies::poll(std::vector<Outcome>& out) {
  std::lock_guard<std::mutex> lock(mu_);
  out.swap(ended_);
  ended_.clear();
}

bool Copies::ended() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !ended_.empty();
}

}  // namespace p2p::core
