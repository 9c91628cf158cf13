// The CUDA copier: staging copies on the engine's own stream, completion by events. Runs on
// the worker thread only, which it makes current on the engine's device.
#include <cuda_runtime.h>

#include <deque>
#include <vector>

#include "common/error.h"
#include "common/log.h"
#include "cuda/copier.h"
#include "cuda/copy_kernels.h"
#include "cuda/device.h"

namespace p2p::cuda {
namespace {

using core::Copier;
using core::CopySpan;

// NOTE: few large spans go to the copy engines (cudaMemcpyAsync); many small ones to one
// gather kernel, which beats a memcpy call per 4 KiB page by far.
constexpr size_t kMemcpySpans = 8;

class CudaCopier final : public Copier {
 public:
  explicit CudaCopier(int device) : device_(device) {
    P2P_CUDA_CHECK(cudaSetDevice(device), "cudaSetDevice(", device, ")");
    P2P_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "creating the staging stream");
  }
  ~CudaCopier() override {
    cudaStreamSynchronize(stream_);
    for (auto& [ticket, ev] : outstanding_) cudaEventDestroy(ev);
    cudaStreamDestroy(stream_);
  }

  uint64_t copy(const CopySpan* spans, size_t n, void* after) override {
    if (after) note(cudaStreamWaitEvent(stream_, static_cast<cudaEvent_t>(after), 0));
    if (n <= kMemcpySpans) {
      for (size_t i = 0; i < n; ++i)
        note(cudaMemcpyAsync(spans[i].dst, spans[i].src, spans[i].len, cudaMemcpyDefault, stream_));
    } else {
      note(p2p::cuda::launch_copy_spans(spans, n, stream_));
    }
    auto ev = static_cast<cudaEvent_t>(cuda::take_event(device_));
    note(cudaEventRecord(ev, stream_));
    outstanding_.emplace_back(++issued_, ev);
    return issued_;
  }

  // One stream: a ticket is done once every earlier one is.
  bool done(uint64_t ticket) override {
    while (ticket > completed_ && !outstanding_.empty()) {
      auto [t, ev] = outstanding_.front();
      const cudaError_t rc = cudaEventQuery(ev);
      if (rc == cudaErrorNotReady) break;
      note(rc);
      completed_ = t;
      cuda::recycle_event(device_, ev);
      outstanding_.pop_front();
    }
    return ticket <= completed_;
  }

  std::string error() const override { return error_; }

  bool event_done(void* event) override {
    const cudaError_t rc = cudaEventQuery(static_cast<cudaEvent_t>(event));
    if (rc == cudaErrorNotReady) return false;
    note(rc);
    return true;
  }
  void release_event(void* event) override { cuda::recycle_event(device_, event); }

  void* record_provider_event() override {
    auto ev = static_cast<cudaEvent_t>(cuda::take_event(device_));
    note(cudaEventRecord(ev, cudaStreamLegacy));
    return ev;
  }

  void* alloc_pinned(size_t bytes) override {
    void* p = nullptr;
    P2P_CUDA_CHECK(cudaHostAlloc(&p, bytes, cudaHostAllocPortable | cudaHostAllocMapped),
                   "allocating ", bytes, " bytes of pinned staging memory");
    return p;
  }
  void free_pinned(void* ptr) override { cudaFreeHost(ptr); }
  void* alloc_device(size_t bytes) override {
    void* p = nullptr;
    P2P_CUDA_CHECK(cudaMalloc(&p, bytes), "cudaMalloc(", bytes, ")");
    return p;
  }
  void free_device(void* ptr) override { cudaFree(ptr); }

 private:
  void note(cudaError_t rc) {
    if (rc == cudaSuccess || !error_.empty()) return;
    error_ = cudaGetErrorString(rc);
    P2P_LOG(Error, "CUDA error on the staging stream: ", error_);
  }

  int device_;
  cudaStream_t stream_ = nullptr;
  std::deque<std::pair<uint64_t, cudaEvent_t>> outstanding_;
  uint64_t issued_ = 0, completed_ = 0;
  std::string error_;
};

}  // namespace

std::unique_ptr<Copier> make_copier(int cuda_device) { return std::make_unique<CudaCopier>(cuda_device); }

}  // namespace p2p::cuda
