// Copier: moves bytes between registered memory and the staging slots for the staged path,
// and owns what the worker needs of CUDA (device, events, pinned memory). The host copier
// copies synchronously; the CUDA one (csrc/cuda/copier.cpp) queues copies on its own
// stream and reports completion through events, so the worker never blocks on the GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace p2p::core {

struct CopySpan {
  void* dst;
  const void* src;
  uint64_t len;
};

// Pages of one size at strided addresses: page k moves `bytes` from src + src_ids[k] *
// src_stride to dst + dst_ids[k] * dst_stride.
struct CopyPages {
  void* dst;
  const void* src;
  int64_t dst_stride, src_stride;
  const int64_t* dst_ids;
  const int64_t* src_ids;
  uint64_t bytes, n;
};

class Copier {
 public:
  virtual ~Copier() = default;
  // Queues copies of GPU memory to or from pinned slot memory, after the work behind `after`
  // (a cudaEvent_t of the caller's stream, or null). `spans` lies in pinned memory, where
  // the gather kernel reads it. Returns a ticket for done(). Host copies never come here:
  // the worker memcpy's them itself.
  virtual uint64_t copy(const CopySpan* spans, size_t n, void* after) = 0;
  virtual bool done(uint64_t ticket) = 0;
  // The first CUDA error seen, empty if none: copies after it cannot be trusted.
  virtual std::string error() const = 0;
  // The caller's event, recorded at submit time: has its work finished? Frees nothing.
  virtual bool event_done(void* event) = 0;
  // Hands back an event of record_event or record_provider_event that nothing waits on.
  virtual void release_event(void* event) = 0;
  // An event after the copies this thread's provider queued on the legacy default stream
  // (shm's CUDA IPC path), for event_done(); null where there can be none (host engines).
  virtual void* record_provider_event() = 0;
  // Page-aligned memory that NICs and (for CUDA) DMA engines can use.
  virtual void* alloc_pinned(size_t bytes) = 0;
  virtual void free_pinned(void* ptr) = 0;
  // GPU memory of the engine's device (nullptr for the host copier): for probing FI_HMEM.
  virtual void* alloc_device(size_t bytes) = 0;
  virtual void free_device(void* ptr) = 0;
};

// The copier of a host engine (cuda/copier.h has the CUDA one).
std::unique_ptr<Copier> make_host_copier();

}  // namespace p2p::core
