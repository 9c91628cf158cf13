#include "core/copier.h"

#include <cstdlib>
#include <cstring>

#include "common/error.h"

namespace p2p::core {

namespace {

class HostCopier final : public Copier {
 public:
  uint64_t copy(const CopySpan*, size_t, void*) override {
    P2P_THROW(ErrorKind::Generic, "a host engine was asked to copy GPU memory");
  }
  bool done(uint64_t) override { return true; }
  std::string error() const override { return {}; }
  bool event_done(void*) override { return true; }
  void release_event(void*) override {}
  void* record_provider_event() override { return nullptr; }
  void* alloc_pinned(size_t bytes) override {
    void* p = nullptr;
    P2P_CHECK(posix_memalign(&p, 4096, bytes) == 0, ErrorKind::Generic, "cannot allocate ",
              bytes, " bytes of staging memory");
    return p;
  }
  void free_pinned(void* ptr) override { std::free(ptr); }
  void* alloc_device(size_t) override { return nullptr; }
  void free_device(void*) override {}
};

}  // namespace

std::unique_ptr<Copier> make_host_copier() { return std::make_unique<HostCopier>(); }

}  // namespace p2p::core
