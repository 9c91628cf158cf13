// SharedFile: the shared-memory file that holds a host region of ours (a tensor after torch's
// share_memory_()), which the cma route hands to same-host peers to map (descriptors.h)
// instead of copying through the kernel. Learnt at registration from the storage's allocator
// (Route::learn) and kept with the region; sent in the route's answers for it (Grants).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>

#include "core/region.h"

namespace c10 {
struct StorageImpl;
}  // namespace c10

namespace p2p::cma {

// The file's descriptor in the owner's process, the region's offset in it, and the file's
// identity, which whoever takes the descriptor checks (a descriptor number may be reused once
// closed). The tensor's allocator owns the descriptor (the engine keeps the tensor while the
// region lives), or, for a file torch mapped by name and closed, `opened` does.
struct SharedFile final : core::RouteState {
  int32_t fd = -1;
  uint64_t offset = 0;
  uint64_t device = 0, inode = 0;  // st_dev, st_ino
  std::shared_ptr<const int> opened;  // closes fd with the last copy, where we opened it

  // The file of the storage's bytes [ptr, ptr + nbytes), where torch's allocator mapped it
  // shared from a file: one it keeps open (share_memory_()), or one it mapped by name and closed
  // (torch.from_file(..., shared=True)), opened again here if this process's mapping is still
  // of that file; else null.
  static std::unique_ptr<SharedFile> of(const c10::StorageImpl& storage, const uint8_t* ptr, uint64_t nbytes);
  // As an answer of the route carries it (Grants::Granting), and back (none from bytes that
  // are not one).
  std::string encode() const;
  static std::optional<SharedFile> decode(std::string_view bytes);
};

// The file `fd` (ours now; closed here) mapped into this process from the region's byte at
// `file.offset` for `nbytes`; null with errno set where the descriptor does not name the file
// the owner answered with, or is too short for the region.
std::shared_ptr<uint8_t> map_file(int fd, const SharedFile& file, uint64_t nbytes, bool writable);

// Faults the pages of new mappings in, a few MiB at a time, on a thread of its own at a lower
// priority, so that a copy need not fault in each page it touches first.
// NOTE: such a fault costs about 1 us a 4 KiB page on the 2-core VM here, 0.25 ms a MiB: more
// than the MiB's copy, paid by every block a cache has not read before (docs/performance_host.md).
// A mapping released meanwhile is dropped at its next chunk; where the kernel cannot populate
// (before Linux 5.14) pages fault in as they are first copied, as without this.
// Thread model: add() from the worker; the destructor stops and joins the thread.
class Populator {
 public:
  Populator() = default;
  ~Populator();
  Populator(const Populator&) = delete;
  Populator& operator=(const Populator&) = delete;

  void add(const std::shared_ptr<uint8_t>& mapping, uint64_t nbytes, bool writable);

 private:
  struct Job {
    std::weak_ptr<uint8_t> mapping;
    uint64_t nbytes = 0;
    bool writable = false;
  };
  void run();

  std::mutex mu_;
  std::condition_variable wake_;
  std::deque<Job> jobs_;
  bool stop_ = false;
  std::thread thread_;  // from the first add()
};

}  // namespace p2p::cma
