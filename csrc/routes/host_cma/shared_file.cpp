#include "routes/host_cma/shared_file.h"

#include <ATen/MapAllocator.h>
#include <c10/core/StorageImpl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "common/wire.h"

namespace p2p::cma {

std::unique_ptr<SharedFile> SharedFile::of(const c10::StorageImpl& storage, const uint8_t* ptr, uint64_t nbytes) {
  const at::MapAllocator* map = at::MapAllocator::fromDataPtr(storage.data_ptr());
  if (!map || map->fd() < 0 || !(map->flags() & (at::ALLOCATOR_MAPPED_SHARED | at::ALLOCATOR_MAPPED_SHAREDMEM)))
    return nullptr;
  const auto* base = static_cast<const uint8_t*>(map->data());
  if (ptr < base || ptr + nbytes > base + map->size()) return nullptr;
  struct stat st {};
  if (fstat(map->fd(), &st) != 0) return nullptr;
  auto file = std::make_unique<SharedFile>();
  file->fd = map->fd();
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

}  // namespace p2p::cma
