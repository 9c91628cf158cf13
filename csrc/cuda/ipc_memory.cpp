// The CUDA side of the IPC route: legacy cudaIpc* handles on the caching allocator's blocks,
// VMM allocations (vmm.h) where the memory is an expandable segment's.
#include "cuda/ipc_memory.h"

#include "common/error.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <limits>
#include <unordered_map>

#include "common/counters.h"
#include "common/log.h"
#include "cuda/copy_kernels.h"
#include "cuda/device.h"
#include "cuda/vmm.h"

namespace p2p::cuda {
namespace {

// The allocation that holds ptr (driver call through the runtime: no libcuda link).
bool address_range(uint64_t ptr, uint64_t& base, uint64_t& size) {
  using Range = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static const auto range = reinterpret_cast<Range>(cuda::driver_function("cuMemGetAddressRange"));
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

class CudaMemory final : public IpcMemory {
 public:
  CudaMemory(int device, uint64_t copy_engine_bytes) : device_(device), copy_engine_bytes_(copy_engine_bytes) {
    P2P_CUDA_CHECK(cudaSetDevice(device), "cudaSetDevice(", device, ")");
    P2P_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "creating the IPC stream");
    P2P_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&done_.arrivals), sizeof(unsigned)), "allocating a counter");
    P2P_CUDA_CHECK(cudaMemset(done_.arrivals, 0, sizeof(unsigned)), "zeroing a counter");
    flag_ = static_cast<uint64_t*>(mapped(sizeof(uint64_t), &done_.flag));
    *flag_ = 0;
    // Off the request path: a kernel not loaded yet is loaded at its first launch.
    if (const cudaError_t rc = cuda::load_copy_kernels(); rc != cudaSuccess) {
      cudaGetLastError();
      P2P_LOG(Warn, "the IPC copy kernels could not be loaded ahead (", cudaGetErrorString(rc),
              "): the first copy of each kind loads its own");
    }
  }
  ~CudaMemory() override {
    cudaStreamSynchronize(stream_);  // a batch never flushed is dropped: its transfers failed
    for (auto& t : outstanding_) cudaEventDestroy(t.event);
    for (Pinned& b : blocks_) cudaFreeHost(b.host);
    cudaFreeHost(flag_);
    cudaFree(done_.arrivals);
    cudaStreamDestroy(stream_);
  }

  Export export_storage(void* ptr, uint64_t nbytes, std::string& why) override {
    Export e;
    const uint64_t p = reinterpret_cast<uint64_t>(ptr);
    if (cuda::is_vmm_memory(ptr)) {
      const std::vector<VmmChunk> chunks = vmm_layout(p, nbytes, why);
      if (chunks.empty()) return e;
      e.kind = Export::Vmm;
      e.offset = p - chunks[0].base;
      return e;
    }
    uint64_t base = 0, size = 0;
    if (!address_range(p, base, size) || p + nbytes > base + size) {
      why = "its allocation could not be found";
      return e;
    }
    cudaIpcMemHandle_t handle;
    const cudaError_t rc = cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(base));
    if (rc != cudaSuccess) {
      cudaGetLastError();
      why = cat("cudaIpcGetMemHandle: ", cudaGetErrorString(rc));
      return e;
    }
    e.kind = Export::Legacy;
    e.handle.assign(reinterpret_cast<const char*>(&handle), sizeof handle);
    e.offset = p - base;
    return e;
  }

  std::vector<VmmChunk> export_vmm(uint64_t ptr, uint64_t nbytes, std::string& why) override {
    return vmm_export(ptr, nbytes, why);
  }

  void* open(const std::string& bytes, uint64_t& size) override {
    P2P_CHECK(bytes.size() == sizeof(cudaIpcMemHandle_t), ErrorKind::Value, "bad CUDA IPC handle");
    cudaIpcMemHandle_t handle;
    std::memcpy(&handle, bytes.data(), sizeof handle);
    void* base = nullptr;
    P2P_CUDA_CHECK(cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess),
                   "cudaIpcOpenMemHandle");
    uint64_t b = 0;
    if (!address_range(reinterpret_cast<uint64_t>(base), b, size)) {
      cudaIpcCloseMemHandle(base);
      P2P_THROW(ErrorKind::Generic, "the size of a mapped CUDA IPC allocation is unknown");
    }
    return base;
  }

  void* open_vmm(std::vector<VmmChunk>& chunks, uint64_t& size) override {
    size = 0;
    for (const VmmChunk& c : chunks) size += c.size;
    void* base = reinterpret_cast<void*>(vmm_import(device_, chunks));
    vmm_.emplace(base, size);
    return base;
  }

  void close(void* base) override {
    if (auto vmm = vmm_.find(base); vmm != vmm_.end()) {
      vmm_unmap(reinterpret_cast<uint64_t>(base), vmm->second);
      vmm_.erase(vmm);
      return;
    }
    if (cudaIpcCloseMemHandle(base) != cudaSuccess) cudaGetLastError();
  }

  // Mapping by mapping: a VMM storage may span several.
  bool owns(uint64_t ptr, uint64_t nbytes) override {
    for (uint64_t at = ptr, base = 0, size = 0; at < ptr + nbytes; at = base + size)
      if (!address_range(at, base, size) || base + size <= at) return false;
    return nbytes > 0;
  }

  // A call's stream wait and its copy-engine copies go out at once; its kernel spans fill a
  // descriptor block (launched when full) and its small pages join the batch that flush()
  // launches: the calls of one worker turn share a launch. A wait first launches the batch
  // before it, so no copy ever waits behind a later call's stream (which may wait for it).
  uint64_t copy(const std::vector<core::CopySpan>& spans, const std::vector<core::CopyPages>& pages,
                void* after) override {
    if (after) {
      flush();
      note(cudaStreamWaitEvent(stream_, static_cast<cudaEvent_t>(after), 0));
    }
    big_pages_.clear();
    const size_t first = lists_.size();
    try {
      for (const core::CopyPages& p : pages) {
        if (p.bytes <= kKernelSpan && queue_pages(p, first)) continue;
        for (uint64_t k = 0; k < p.n; ++k)
          big_pages_.push_back({static_cast<char*>(p.dst) + p.dst_ids[k] * p.dst_stride,
                                static_cast<const char*>(p.src) + p.src_ids[k] * p.src_stride, p.bytes});
      }
      queue_spans(spans);
      queue_spans(big_pages_);
    } catch (const std::exception& e) {  // no pinned memory for a descriptor block
      fail_batch(e.what());
    }
    queued_ = true;
    return issued_ + 1;
  }

  void flush() override {
    if (!queued_) return;
    // Only the last launch signals (the stream runs launches in order), and it comes after
    // every copy-engine copy of the batch, so its flag covers them.
    try {
      launch_spans(lists_.empty());
      launch_pages();
      if (!pending_.signaled) {
        // Not recorded: the copies went out all the same, and the stream query (finished())
        // says when they are over and whether they failed.
        std::string why;
        if (!(pending_.event = record(why)))
          P2P_LOG(Warn, "no event closes a batch of CUDA IPC copies (", why, "): its end is taken from the stream");
      }
    } catch (const Error& e) {  // no pinned memory for the descriptors
      fail_batch(e.what());
    }
    lists_.clear();  // launched or failed: the batch is over either way
    packed_.clear();
    pending_.id = ++issued_;
    outstanding_.push_back(std::move(pending_));
    pending_ = {};
    queued_ = false;
  }

  bool done(uint64_t ticket) override {
    while (ticket > completed_ && !outstanding_.empty()) {
      Ticket& t = outstanding_.front();
      if (!finished(t)) break;
      completed_ = t.id;
      if (!t.failed.empty()) failures_.emplace_back(t.id, std::move(t.failed));
      if (t.event) cuda::recycle_event(device_, t.event);
      for (size_t b : t.blocks) free_blocks_.push_back(b);
      outstanding_.pop_front();
    }
    return ticket <= completed_;
  }

  void* mark() override {
    flush();
    std::string why;
    void* event = record(why);
    if (!event) P2P_LOG(Warn, "no event for a stream wait: ", why);
    return event;
  }

  std::string error(uint64_t ticket) override {
    if (!error_.empty()) return error_;
    while (!failures_.empty() && failures_.front().first < ticket) failures_.pop_front();
    return !failures_.empty() && failures_.front().first == ticket ? failures_.front().second : std::string();
  }

 private:
  struct Ticket {
    uint64_t id = 0;
    bool signaled = false;         // its last kernel writes flag_; else
    cudaEvent_t event = nullptr;   // recorded after its copies (neither: its launch failed)
    std::string failed;            // why some of its copies did not go out
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
  void queue_spans(const std::vector<core::CopySpan>& spans) {
    uint64_t engine_spans = 0;
    for (const core::CopySpan& s : spans) {
      if (s.len >= copy_engine_bytes_) {
        ++engine_spans;
        note(cudaMemcpyAsync(s.dst, s.src, s.len, cudaMemcpyDefault, stream_));
        continue;
      }
      for (uint64_t off = 0; off < s.len; off += kKernelSpan) {
        if (spans_.used == kBlockSpans) launch_spans(false);
        if (!spans_.block) spans_.block = &take_pinned(kBlockSpans * sizeof(core::CopySpan));
        reinterpret_cast<core::CopySpan*>(spans_.block->host)[spans_.used++] = {
            static_cast<char*>(s.dst) + off, static_cast<const char*>(s.src) + off, std::min(kKernelSpan, s.len - off)};
      }
    }
    count(Counter::IpcCopyEngineSpans, engine_spans);
    count(Counter::IpcKernelSpans, spans.size() - engine_spans);
  }

  void launch_spans(bool last) {
    if (!spans_.used) return;
    note(cuda::launch_copy_spans(reinterpret_cast<core::CopySpan*>(spans_.block->device), spans_.used, stream_,
                                 signal_if(last)));
    spans_ = {};
  }

  // A list of small pages joins the batch with a copy of its ids as 32-bit pairs (the
  // caller's may be gone by the launch); a list that shares its ids with the one before in the
  // same call (a KV cache's layers) shares the pairs. `first`: the call's first list in the
  // batch. False if an id does not fit 32 bits: the caller sends those pages as spans.
  bool queue_pages(const core::CopyPages& p, size_t first) {
    cuda::PackedPages list{p.dst, p.src, p.dst_stride, p.src_stride, p.bytes, static_cast<uint32_t>(p.n), 0};
    if (lists_.size() > first && lists_.back().n == p.n && last_src_ids_ == p.src_ids && last_dst_ids_ == p.dst_ids) {
      list.pairs = lists_.back().pairs;
      lists_.push_back(list);
      return true;
    }
    constexpr uint64_t kMax = std::numeric_limits<int32_t>::max();  // a negative id, cast, is larger
    const size_t at = packed_.size();
    if (p.n > kMax || at > std::numeric_limits<uint32_t>::max()) return false;
    packed_.resize(at + p.n * sizeof(cuda::PagePair));
    auto* pairs = reinterpret_cast<cuda::PagePair*>(packed_.data() + at);
    for (uint64_t k = 0; k < p.n; ++k) {
      const auto src = static_cast<uint64_t>(p.src_ids[k]), dst = static_cast<uint64_t>(p.dst_ids[k]);
      if (src > kMax || dst > kMax) {
        packed_.resize(at);
        return false;
      }
      pairs[k] = {static_cast<int32_t>(src), static_cast<int32_t>(dst)};
    }
    last_src_ids_ = p.src_ids;
    last_dst_ids_ = p.dst_ids;
    list.pairs = static_cast<uint32_t>(at);
    lists_.push_back(list);
    return true;
  }

  // The batch's pairs, then its lists, go with the launch (a block small enough for its
  // parameters) or to one pinned block that the kernel reads.
  void launch_pages() {
    if (lists_.empty()) return;
    const size_t lists = packed_.size(), count = lists_.size();
    const auto* from = reinterpret_cast<const char*>(lists_.data());
    packed_.insert(packed_.end(), from, from + count * sizeof(cuda::PackedPages));
    const char* device = nullptr;
    if (packed_.size() > cuda::kPackedParamBytes) {
      Pinned& block = take_pinned(packed_.size());
      std::memcpy(block.host, packed_.data(), packed_.size());
      device = block.device;
    }
    for (size_t first = 0; first < count; first += cuda::kMaxPageLists) {
      const size_t n = std::min(cuda::kMaxPageLists, count - first);
      uint64_t most = 0;
      for (size_t i = first; i < first + n; ++i) most = std::max<uint64_t>(most, lists_[i].n);
      note(cuda::launch_packed_pages(packed_.data(), device, packed_.size(), lists + first * sizeof(cuda::PackedPages),
                                     n, most, stream_, signal_if(first + n == count)));
    }
  }

  // An event recorded on the stream after the work queued so far, or null (`why` says why) if
  // none could be had or the record failed: an event never recorded would read as done.
  cudaEvent_t record(std::string& why) {
    try {
      return static_cast<cudaEvent_t>(cuda::record_event(device_, stream_));
    } catch (const Error& e) {
      why = e.what();
      return nullptr;
    }
  }

  cuda::CopyDone signal_if(bool last) {
    if (!last) return {};
    cuda::CopyDone done = done_;
    done.value = issued_ + 1;
    pending_.signaled = true;
    return done;
  }

  bool finished(const Ticket& t) {
    if (t.event) {
      const cudaError_t rc = cudaEventQuery(t.event);
      if (rc == cudaErrorNotReady) return false;
      stick(rc);
      return true;
    }
    if (t.signaled && __atomic_load_n(flag_, __ATOMIC_ACQUIRE) >= t.id) return true;
    // A kernel that faults never writes the flag, and a batch whose launch failed has neither
    // flag nor event: the stream says when they are over, asked now and then (a CUDA call per
    // poll would contend with the threads that submit).
    const auto now = std::chrono::steady_clock::now();
    if (now < next_stream_check_) return false;
    next_stream_check_ = now + std::chrono::milliseconds(1);
    const cudaError_t rc = cudaStreamQuery(stream_);
    if (rc == cudaErrorNotReady) return false;
    stick(rc);
    return true;
  }

  // Pinned host memory the GPU reaches too; its device address goes to `device`.
  template <typename T>
  void* mapped(size_t bytes, T** device) {
    void* host = nullptr;
    P2P_CUDA_CHECK(cudaHostAlloc(&host, bytes, cudaHostAllocPortable | cudaHostAllocMapped), "allocating pinned memory");
    void* dev = nullptr;
    P2P_CUDA_CHECK(cudaHostGetDevicePointer(&dev, host, 0), "mapping pinned memory");
    *device = static_cast<T*>(dev);
    return host;
  }

  // Descriptor blocks return when their copy is done, so the pool grows only to what the
  // launches in flight hold. A block serves any request up to its size.
  Pinned& take_pinned(size_t bytes) {
    auto fits = std::find_if(free_blocks_.begin(), free_blocks_.end(), [&](size_t b) { return blocks_[b].bytes >= bytes; });
    if (fits == free_blocks_.end()) {
      Pinned b;
      b.bytes = kBlockSpans * sizeof(core::CopySpan);
      while (b.bytes < bytes) b.bytes *= 2;
      b.host = static_cast<char*>(mapped(b.bytes, &b.device));
      blocks_.push_back(b);
      free_blocks_.push_back(blocks_.size() - 1);
      fits = free_blocks_.end() - 1;
    }
    pending_.blocks.push_back(*fits);
    free_blocks_.erase(fits);
    return blocks_[pending_.blocks.back()];
  }

  // A call that queues work refused it: the batch being queued fails.
  void note(cudaError_t rc) {
    if (rc == cudaSuccess) return;
    cudaGetLastError();
    fail_batch(cudaGetErrorString(rc));
  }

  void fail_batch(const std::string& why) {
    if (!pending_.failed.empty()) return;
    pending_.failed = why;
    P2P_LOG(Error, "a batch of CUDA IPC copies failed: ", why);
  }

  // The stream reported an error of work that ran: the context is broken for good.
  void stick(cudaError_t rc) {
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
  // The batch that flush() launches: its ticket, kernel spans not launched yet, small pages
  // (their pairs packed, the lists appended at the launch).
  Ticket pending_;
  SpanBatch spans_;
  std::vector<cuda::PackedPages> lists_;
  std::vector<char> packed_;
  const int64_t* last_src_ids_ = nullptr;  // the caller's ids of the last list queued
  const int64_t* last_dst_ids_ = nullptr;
  bool queued_ = false;
  std::vector<core::CopySpan> big_pages_;  // reused by copy(): pages too long for the page kernel
  uint64_t issued_ = 0, completed_ = 0;
  std::string error_;                                   // stick()'s
  std::deque<std::pair<uint64_t, std::string>> failures_;  // done tickets that failed, for error()
  std::unordered_map<void*, uint64_t> vmm_;  // open_vmm()'s ranges: base -> size
};

}  // namespace

std::unique_ptr<IpcMemory> make_ipc_memory(int cuda_device, uint64_t copy_engine_bytes) {
  return std::make_unique<CudaMemory>(cuda_device, copy_engine_bytes);
}

}  // namespace p2p::cuda
