// The CUDA side of the IPC route (legacy cudaIpc* handles on the caching allocator's blocks).
#include "ipc/memory.h"

#include "common/error.h"

#ifdef WITH_CUDA
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>

#include "common/log.h"
#include "cuda/copy_kernels.h"
#include "cuda/device.h"

namespace p2p::ipc {
namespace {

#define IPC_CUDA_CHECK(call, ...)                                                             \
  do {                                                                                         \
    const cudaError_t rc_ = (call);                                                            \
    if (rc_ != cudaSuccess) {                                                                  \
      cudaGetLastError();                                                                      \
      P2P_THROW(ErrorKind::Generic, __VA_ARGS__, ": ", cudaGetErrorString(rc_));              \
    }                                                                                          \
  } while (0)

// The allocation that holds ptr (driver call through the runtime: no libcuda link).
bool address_range(uint64_t ptr, uint64_t& base, uint64_t& size) {
  using Range = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static const Range range = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess || found != cudaDriverEntryPointSuccess)
      return static_cast<Range>(nullptr);
    return reinterpret_cast<Range>(fn);
  }();
  CUdeviceptr b = 0;
  size_t s = 0;
  if (!range || range(&b, &s, static_cast<CUdeviceptr>(ptr)) != CUDA_SUCCESS) return false;
  base = b;
  size = s;
  return true;
}

// NOTE: a kernel span is at most this long, so that a few large runs still spread over many
// thread blocks; the copy engines take spans from copy_engine_bytes up (default 16 MiB: on the
// GPU machine, 16 runs per call of 1 / 4 / 16 MiB moved at 2320 / 2746 / 2905 Gbps by kernel
// and 1735 / 2557 / 2913 Gbps by cudaMemcpyAsync; from 16 MiB on the copy engines match the
// kernel and leave the SMs free).
constexpr uint64_t kKernelSpan = 64 << 10;
constexpr size_t kBlockSpans = 4096;  // spans per pinned descriptor block (one launch)

class CudaMemory final : public Memory {
 public:
  CudaMemory(int device, uint64_t copy_engine_bytes) : device_(device), copy_engine_bytes_(copy_engine_bytes) {
    IPC_CUDA_CHECK(cudaSetDevice(device), "cudaSetDevice(", device, ")");
    IPC_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "creating the IPC stream");
    IPC_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&done_.arrivals), sizeof(unsigned)), "allocating a counter");
    IPC_CUDA_CHECK(cudaMemset(done_.arrivals, 0, sizeof(unsigned)), "zeroing a counter");
    flag_ = static_cast<uint64_t*>(mapped(sizeof(uint64_t), &done_.flag));
    *flag_ = 0;
  }
  ~CudaMemory() override {
    cudaStreamSynchronize(stream_);
    for (auto& t : outstanding_) cudaEventDestroy(t.event);
    for (Pinned& b : blocks_) cudaFreeHost(b.host);
    cudaFreeHost(flag_);
    cudaFree(done_.arrivals);
    cudaStreamDestroy(stream_);
  }

  engine::IpcExport export_storage(void* ptr, uint64_t nbytes, std::string& why) override {
    engine::IpcExport e;
    uint64_t base = 0, size = 0;
    const uint64_t p = reinterpret_cast<uint64_t>(ptr);
    if (!address_range(p, base, size) || p + nbytes > base + size) {
      why = "its allocation could not be found";
      return e;
    }
    cudaIpcMemHandle_t handle;
    const cudaError_t rc = cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(base));
    if (rc != cudaSuccess) {
      cudaGetLastError();
      why = cat("cudaIpcGetMemHandle: ", cudaGetErrorString(rc),
                " (VMM memory such as PyTorch's expandable segments is not exported yet)");
      return e;
    }
    e.handle.assign(reinterpret_cast<const char*>(&handle), sizeof handle);
    e.offset = p - base;
    e.ptr = p;
    return e;
  }

  void* open(const std::string& bytes, uint64_t& size) override {
    P2P_CHECK(bytes.size() == sizeof(cudaIpcMemHandle_t), ErrorKind::Value, "bad CUDA IPC handle");
    cudaIpcMemHandle_t handle;
    std::memcpy(&handle, bytes.data(), sizeof handle);
    void* base = nullptr;
    IPC_CUDA_CHECK(cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess),
                   "cudaIpcOpenMemHandle");
    uint64_t b = 0;
    if (!address_range(reinterpret_cast<uint64_t>(base), b, size)) {
      cudaIpcCloseMemHandle(base);
      P2P_THROW(ErrorKind::Generic, "the size of a mapped CUDA IPC allocation is unknown");
    }
    return base;
  }

  void close(void* base) override {
    if (cudaIpcCloseMemHandle(base) != cudaSuccess) cudaGetLastError();
  }

  bool owns(uint64_t ptr, uint64_t nbytes) override {
    uint64_t base = 0, size = 0;
    return address_range(ptr, base, size) && ptr + nbytes <= base + size;
  }

  uint64_t copy(const std::vector<engine::CopySpan>& spans, const std::vector<engine::CopyPages>& pages,
                void* after) override {
    Ticket t;
    if (after) note(cudaStreamWaitEvent(stream_, static_cast<cudaEvent_t>(after), 0));
    small_pages_.clear();
    big_pages_.clear();
    for (const engine::CopyPages& p : pages) {
      if (p.bytes <= kKernelSpan) {
        small_pages_.push_back(p);
        continue;
      }
      for (uint64_t k = 0; k < p.n; ++k)
        big_pages_.push_back({static_cast<char*>(p.dst) + p.dst_ids[k] * p.dst_stride,
                              static_cast<const char*>(p.src) + p.src_ids[k] * p.src_stride, p.bytes});
    }
    SpanBatch batch;
    queue_spans(spans, batch, t);
    queue_spans(big_pages_, batch, t);
    // Only the last launch signals (the stream runs launches in order), and it comes after
    // every copy-engine copy of the call, so its flag covers them.
    launch_spans(batch, small_pages_.empty(), t);
    launch_pages(t);
    if (!t.signaled) {
      t.event = static_cast<cudaEvent_t>(cuda::take_event(device_));
      note(cudaEventRecord(t.event, stream_));
    }
    t.id = ++issued_;
    outstanding_.push_back(std::move(t));
    return issued_;
  }

  bool done(uint64_t ticket) override {
    while (ticket > completed_ && !outstanding_.empty()) {
      Ticket& t = outstanding_.front();
      if (!finished(t)) break;
      completed_ = t.id;
      if (t.event) cuda::recycle_event(device_, t.event);
      for (size_t b : t.blocks) free_blocks_.push_back(b);
      outstanding_.pop_front();
    }
    return ticket <= completed_;
  }

  void* mark() override {
    try {
      auto event = static_cast<cudaEvent_t>(cuda::take_event(device_));
      if (cudaEventRecord(event, stream_) == cudaSuccess) return event;
      cudaGetLastError();
      cuda::recycle_event(device_, event);
    } catch (const Error& e) {
      P2P_LOG(Warn, "no event for a stream wait: ", e.what());
    }
    return nullptr;
  }

  std::string error() const override { return error_; }

 private:
  struct Ticket {
    uint64_t id = 0;
    bool signaled = false;         // its last kernel writes flag_; else
    cudaEvent_t event = nullptr;   // recorded after its copies
    std::vector<size_t> blocks;  // indexes into blocks_, returned when the copy is done
  };
  struct Pinned {
    char* host = nullptr;    // pinned and mapped, filled by the worker
    char* device = nullptr;  // the same memory as the kernel addresses it
    size_t bytes = 0;
  };

  struct SpanBatch {  // kernel spans written to a pinned block, not launched yet
    Pinned* block = nullptr;
    size_t used = 0;
  };

  // Copy-engine copies go out at once; the rest fill descriptor blocks, launched when full.
  void queue_spans(const std::vector<engine::CopySpan>& spans, SpanBatch& batch, Ticket& t) {
    for (const engine::CopySpan& s : spans) {
      if (s.len >= copy_engine_bytes_) {
        note(cudaMemcpyAsync(s.dst, s.src, s.len, cudaMemcpyDefault, stream_));
        continue;
      }
      for (uint64_t off = 0; off < s.len; off += kKernelSpan) {
        if (batch.used == kBlockSpans) launch_spans(batch, false, t);
        if (!batch.block) batch.block = &take_pinned(kBlockSpans * sizeof(engine::CopySpan), t);
        reinterpret_cast<engine::CopySpan*>(batch.block->host)[batch.used++] = {
            static_cast<char*>(s.dst) + off, static_cast<const char*>(s.src) + off, std::min(kKernelSpan, s.len - off)};
      }
    }
  }

  void launch_spans(SpanBatch& batch, bool last, Ticket& t) {
    if (!batch.used) return;
    note(cuda::launch_copy_spans(reinterpret_cast<engine::CopySpan*>(batch.block->device), batch.used, stream_,
                                 signal_if(last, t)));
    batch = {};
  }

  // The small pages' lists and ids go to one pinned block, the kernel reading the ids there.
  // Lists that share their ids with the list before (a KV cache's layers) share them there too.
  void launch_pages(Ticket& t) {
    if (small_pages_.empty()) return;
    const size_t lists = small_pages_.size();
    auto repeats = [&](size_t i) {
      return i > 0 && small_pages_[i].src_ids == small_pages_[i - 1].src_ids &&
             small_pages_[i].dst_ids == small_pages_[i - 1].dst_ids && small_pages_[i].n == small_pages_[i - 1].n;
    };
    size_t ids = 0;
    for (size_t i = 0; i < lists; ++i)
      if (!repeats(i)) ids += 2 * small_pages_[i].n;
    Pinned& block = take_pinned(lists * sizeof(engine::CopyPages) + ids * sizeof(int64_t), t);
    auto* host = reinterpret_cast<engine::CopyPages*>(block.host);
    auto* host_ids = reinterpret_cast<int64_t*>(host + lists);
    auto* device_ids = reinterpret_cast<int64_t*>(reinterpret_cast<engine::CopyPages*>(block.device) + lists);
    auto place = [&](const int64_t* from, uint64_t n) {
      std::memcpy(host_ids, from, n * sizeof(int64_t));
      host_ids += n;
      device_ids += n;
      return device_ids - n;
    };
    for (size_t i = 0; i < lists; ++i) {
      engine::CopyPages p = small_pages_[i];
      if (repeats(i)) {
        p.src_ids = host[i - 1].src_ids;
        p.dst_ids = host[i - 1].dst_ids;
      } else {
        p.src_ids = place(p.src_ids, p.n);
        p.dst_ids = place(p.dst_ids, p.n);
      }
      host[i] = p;
    }
    const auto* device = reinterpret_cast<const engine::CopyPages*>(block.device);
    for (size_t first = 0; first < lists; first += cuda::kMaxPageLists) {
      const size_t count = std::min(cuda::kMaxPageLists, lists - first);
      uint64_t most = 0;
      for (size_t i = first; i < first + count; ++i) most = std::max(most, small_pages_[i].n);
      note(cuda::launch_copy_pages(device + first, count, most, stream_, signal_if(first + count == lists, t)));
    }
  }

  cuda::CopyDone signal_if(bool last, Ticket& t) {
    if (!last) return {};
    cuda::CopyDone done = done_;
    done.value = issued_ + 1;
    t.signaled = true;
    return done;
  }

  bool finished(const Ticket& t) {
    if (!t.signaled) {
      const cudaError_t rc = cudaEventQuery(t.event);
      if (rc == cudaErrorNotReady) return false;
      note(rc);
      return true;
    }
    if (__atomic_load_n(flag_, __ATOMIC_ACQUIRE) >= t.id) return true;
    // A kernel that faults never writes the flag: the stream says so, asked now and then (a
    // CUDA call per poll would contend with the threads that submit).
    const auto now = std::chrono::steady_clock::now();
    if (now < next_stream_check_) return false;
    next_stream_check_ = now + std::chrono::milliseconds(1);
    const cudaError_t rc = cudaStreamQuery(stream_);
    if (rc == cudaErrorNotReady) return false;
    note(rc);
    return true;
  }

  // Pinned host memory the GPU reaches too; its device address goes to `device`.
  template <typename T>
  void* mapped(size_t bytes, T** device) {
    void* host = nullptr;
    IPC_CUDA_CHECK(cudaHostAlloc(&host, bytes, cudaHostAllocPortable | cudaHostAllocMapped), "allocating pinned memory");
    void* dev = nullptr;
    IPC_CUDA_CHECK(cudaHostGetDevicePointer(&dev, host, 0), "mapping pinned memory");
    *device = static_cast<T*>(dev);
    return host;
  }

  // Descriptor blocks return when their copy is done, so the pool grows only to what the
  // launches in flight hold. A block serves any request up to its size.
  Pinned& take_pinned(size_t bytes, Ticket& t) {
    auto fits = std::find_if(free_blocks_.begin(), free_blocks_.end(), [&](size_t b) { return blocks_[b].bytes >= bytes; });
    if (fits == free_blocks_.end()) {
      Pinned b;
      b.bytes = kBlockSpans * sizeof(engine::CopySpan);
      while (b.bytes < bytes) b.bytes *= 2;
      b.host = static_cast<char*>(mapped(b.bytes, &b.device));
      blocks_.push_back(b);
      free_blocks_.push_back(blocks_.size() - 1);
      fits = free_blocks_.end() - 1;
    }
    t.blocks.push_back(*fits);
    free_blocks_.erase(fits);
    return blocks_[t.blocks.back()];
  }

  void note(cudaError_t rc) {
    if (rc == cudaSuccess || !error_.empty()) return;
    cudaGetLastError();
    error_ = cudaGetErrorString(rc);
    P2P_LOG(Error, "CUDA error on the IPC stream: ", error_);
  }

  int device_;
  uint64_t copy_engine_bytes_;
  cudaStream_t stream_ = nullptr;
  cuda::CopyDone done_;      // the counter and flag every final launch uses
  uint64_t* flag_ = nullptr;  // host side of done_.flag: the last ticket whose kernel ended
  std::chrono::steady_clock::time_point next_stream_check_{};
  std::deque<Ticket> outstanding_;
  std::deque<Pinned> blocks_;  // stable addresses
  std::vector<size_t> free_blocks_;
  std::vector<engine::CopyPages> small_pages_;  // reused by copy(): pages for the page kernel
  std::vector<engine::CopySpan> big_pages_;     // and pages too long for it, as spans
  uint64_t issued_ = 0, completed_ = 0;
  std::string error_;
};

}  // namespace

std::unique_ptr<Memory> make_memory(int cuda_device, uint64_t copy_engine_bytes) {
  return std::make_unique<CudaMemory>(cuda_device, copy_engine_bytes);
}

}  // namespace p2p::ipc

#else

namespace p2p::ipc {
std::unique_ptr<Memory> make_memory(int, uint64_t) { return nullptr; }
}  // namespace p2p::ipc

#endif
