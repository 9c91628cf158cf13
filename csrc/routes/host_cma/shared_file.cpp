#include "routes/host_cma/shared_file.h"

#include <ATen/MapAllocator.h>
#include <c10/core/StorageImpl.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>

#include <cerrno>
#include <cstdio>
#include <cstdlib>

#include "common/wire.h"

namespace p2p::cma {

namespace {

// The file (device, inode) that this process maps at `addr`, from /proc/self/maps; false where
// none is.
bool mapped_file(const void* addr, uint64_t& device, uint64_t& inode) {
  FILE* maps = std::fopen("/proc/self/maps", "re");
  if (!maps) return false;
  const auto at = reinterpret_cast<uintptr_t>(addr);
  bool found = false;
  char* line = nullptr;
  size_t cap = 0;
  while (!found && getline(&line, &cap, maps) > 0) {
    unsigned long start = 0, end = 0, offset = 0, ino = 0;
    unsigned major = 0, minor = 0;
    char perms[8];
    if (std::sscanf(line, "%lx-%lx %7s %lx %x:%x %lu", &start, &end, perms, &offset, &major, &minor, &ino) == 7 &&
        start <= at && at < end) {
      found = ino != 0;
      device = makedev(major, minor);
      inode = ino;
    }
  }
  std::free(line);
  std::fclose(maps);
  return found;
}

// A descriptor of the file that torch's allocator mapped shared by its path and closed
// (torch.from_file), if this process's mapping at `base` is still of that file (the path may
// name another since); else -1. Not for shm_open names (ALLOCATOR_MAPPED_SHAREDMEM), no paths.
int reopen(const at::MapAllocator& map, const void* base) {
  const char* path = map.filename();
  uint64_t device = 0, inode = 0;
  if ((map.flags() & at::ALLOCATOR_MAPPED_SHAREDMEM) || !(map.flags() & at::ALLOCATOR_MAPPED_SHARED) || !path ||
      path[0] != '/' || !mapped_file(base, device, inode))
    return -1;
  const int fd = open(path, O_RDWR | O_CLOEXEC);
  struct stat st {};
  if (fd >= 0 && fstat(fd, &st) == 0 && static_cast<uint64_t>(st.st_dev) == device &&
      static_cast<uint64_t>(st.st_ino) == inode)
    return fd;
  if (fd >= 0) close(fd);
  return -1;
}

}  // namespace

std::unique_ptr<SharedFile> SharedFile::of(const c10::StorageImpl& storage, const uint8_t* ptr, uint64_t nbytes) {
  const at::MapAllocator* map = at::MapAllocator::fromDataPtr(storage.data_ptr());
  if (!map || !(map->flags() & (at::ALLOCATOR_MAPPED_SHARED | at::ALLOCATOR_MAPPED_SHAREDMEM))) return nullptr;
  const auto* base = static_cast<const uint8_t*>(map->data());
  if (ptr < base || ptr + nbytes > base + map->size()) return nullptr;
  auto file = std::make_unique<SharedFile>();
  file->fd = map->fd();
  if (file->fd < 0) {
    file->fd = reopen(*map, base);
    if (file->fd < 0) return nullptr;
    file->opened = std::shared_ptr<const int>(new int(file->fd), [](const int* fd) {
      close(*fd);
      delete fd;
    });
  }
  struct stat st {};
  if (fstat(file->fd, &st) != 0) return nullptr;
  file->offset = static_cast<uint64_t>(ptr - base);
  file->device = static_cast<uint64_t>(st.st_dev);
  file->inode = static_cast<uint64_t>(st.st_ino);
  return file;
}

std::string SharedFile::encode() const {
  ByteWriter w;
  w.put(fd);
  w.put(offset);
  w.put(device);
  w.put(inode);
  return std::move(w.str());
}

std::optional<SharedFile> SharedFile::decode(std::string_view bytes) {
  if (bytes.size() != 4 + 8 + 8 + 8) return std::nullopt;
  ByteReader r(bytes, "cma message");
  SharedFile f;
  f.fd = r.get<int32_t>();
  f.offset = r.get<uint64_t>();
  f.device = r.get<uint64_t>();
  f.inode = r.get<uint64_t>();
  return f;
}

std::shared_ptr<uint8_t> map_file(int fd, const SharedFile& file, uint64_t nbytes, bool writable) {
  struct stat st {};
  const uint64_t offset = file.offset, page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t start = offset / page * page;
  const size_t len = offset + nbytes - start;
  void* base = MAP_FAILED;
  errno = 0;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || static_cast<uint64_t>(st.st_dev) != file.device ||
      static_cast<uint64_t>(st.st_ino) != file.inode || static_cast<uint64_t>(st.st_size) < offset + nbytes)
    errno = errno ? errno : ESTALE;
  else
    base = mmap(nullptr, len, PROT_READ | (writable ? PROT_WRITE : 0), MAP_SHARED, fd, static_cast<off_t>(start));
  const int error = errno;
  close(fd);
  errno = error;
  if (base == MAP_FAILED) return nullptr;
  return std::shared_ptr<uint8_t>(static_cast<uint8_t*>(base) + (offset - start), [base, len](uint8_t*) {
    munmap(base, len);
  });
}

Populator::~Populator() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Populator::add(const std::shared_ptr<uint8_t>& mapping, uint64_t nbytes, bool writable) {
  if (!mapping || nbytes == 0) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back({mapping, nbytes, writable});
    if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
  }
  wake_.notify_one();
}

void Populator::run() {
#ifndef MADV_POPULATE_READ  // Linux 5.14; older headers
  constexpr int MADV_POPULATE_READ = 22, MADV_POPULATE_WRITE = 23;
#endif
  constexpr uint64_t kChunk = uint64_t{4} << 20;
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), 10);  // this thread only
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    wake_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
    if (stop_) return;
    Job job = std::move(jobs_.front());
    jobs_.pop_front();
    for (uint64_t done = 0; done < job.nbytes && !stop_;) {
      const std::shared_ptr<uint8_t> mapping = job.mapping.lock();
      if (!mapping) break;
      lock.unlock();
      // From the chunk's first page: the mapping starts at a page, the region need not.
      const uintptr_t from = (reinterpret_cast<uintptr_t>(mapping.get()) + done) / page * page;
      const uint64_t len = std::min(kChunk, job.nbytes - done);
      const int rc = madvise(reinterpret_cast<void*>(from),
                             reinterpret_cast<uintptr_t>(mapping.get()) + done + len - from,
                             job.writable ? MADV_POPULATE_WRITE : MADV_POPULATE_READ);
      lock.lock();
      done = rc == 0 ? done + len : job.nbytes;  // the kernel cannot (EINVAL), or the file shrank (EFAULT)
    }
  }
}

}  // namespace p2p::cma
