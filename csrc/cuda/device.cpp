#include "cuda/device.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include "common/error.h"

namespace p2p::cuda {
namespace {

#define CUDA_OK(call, ...)                                                                    \
  do {                                                                                        \
    const cudaError_t rc_ = (call);                                                           \
    if (rc_ != cudaSuccess) P2P_THROW(ErrorKind::Generic, __VA_ARGS__, ": ", cudaGetErrorString(rc_)); \
  } while (0)

// Driver functions through the runtime, so that the extension does not link libcuda.
template <typename Fn>
Fn driver(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found;
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess)
    return nullptr;
  return reinterpret_cast<Fn>(fn);
}

// Makes `device` current for a scope; no runtime call to switch when it already is (the
// usual case: every transfer's stream event goes through here).
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    cudaGetDevice(&previous_);
    if (previous_ != device) CUDA_OK(cudaSetDevice(device), "cudaSetDevice");
    else previous_ = -1;
  }
  ~DeviceScope() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }

 private:
  int previous_ = -1;
};

}  // namespace

bool is_vmm_memory(const void* ptr) {
  using Retain = CUresult (*)(CUmemGenericAllocationHandle*, void*);
  using Release = CUresult (*)(CUmemGenericAllocationHandle);
  static const auto retain = driver<Retain>("cuMemRetainAllocationHandle");
  static const auto release = driver<Release>("cuMemRelease");
  if (!retain || !release) return false;
  CUmemGenericAllocationHandle handle;
  if (retain(&handle, const_cast<void*>(ptr)) != CUDA_SUCCESS) return false;
  release(handle);
  return true;
}

namespace {
// Events recorded for transfers, by device: creating and destroying one per call costs more
// than the record itself.
std::mutex events_mu;
std::vector<std::vector<cudaEvent_t>> free_events;
}  // namespace

void* take_event(int device) {
  {
    std::lock_guard<std::mutex> lock(events_mu);
    if (static_cast<size_t>(device) < free_events.size() && !free_events[device].empty()) {
      cudaEvent_t ev = free_events[device].back();
      free_events[device].pop_back();
      return ev;
    }
  }
  DeviceScope scope(device);
  cudaEvent_t ev = nullptr;
  CUDA_OK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate");
  return ev;
}

void* record_event(int device, void* stream) {
  auto ev = static_cast<cudaEvent_t>(take_event(device));
  DeviceScope scope(device);
  const cudaError_t rc = cudaEventRecord(ev, static_cast<cudaStream_t>(stream));
  if (rc != cudaSuccess) {
    cudaEventDestroy(ev);
    CUDA_OK(rc, "cudaEventRecord");
  }
  return ev;
}

void recycle_event(int device, void* event) {
  std::lock_guard<std::mutex> lock(events_mu);
  if (free_events.size() <= static_cast<size_t>(device)) free_events.resize(device + 1);
  free_events[device].push_back(static_cast<cudaEvent_t>(event));
}

StreamFlags::StreamFlags(int device, size_t count) : generation_(count, 0) {
  DeviceScope scope(device);
  void* host = nullptr;
  CUDA_OK(cudaHostAlloc(&host, count * sizeof(uint32_t), cudaHostAllocPortable | cudaHostAllocMapped),
          "allocating stream flags");
  host_ = static_cast<uint32_t*>(host);
  void* dev = nullptr;
  CUDA_OK(cudaHostGetDevicePointer(&dev, host, 0), "mapping stream flags");
  device_ptr_ = reinterpret_cast<uint64_t>(dev);
  for (size_t i = 0; i < count; ++i) host_[i] = 0;
  for (size_t i = count; i-- > 0;) free_.push_back(i);
}

StreamFlags::~StreamFlags() {
  // Release every wait and keep the page: a stream may still be about to read its flag, and
  // freeing pinned memory under it would fault. 16 KiB per engine, once.
  for (size_t i = 0; i < generation_.size(); ++i) __atomic_store_n(&host_[i], UINT32_MAX, __ATOMIC_RELEASE);
}

uint64_t StreamFlags::wait(void* stream) {
  using WaitValue = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
  static const auto wait_value = driver<WaitValue>("cuStreamWaitValue32");
  P2P_CHECK(wait_value, ErrorKind::Generic, "this CUDA driver has no cuStreamWaitValue32");
  size_t slot;
  uint32_t value;
  {
    std::lock_guard<std::mutex> lock(mu_);
    P2P_CHECK(!free_.empty(), ErrorKind::Generic, "too many stream waits in flight (",
              generation_.size(), ")");
    slot = free_.back();
    free_.pop_back();
    value = ++generation_[slot];
  }
  const CUresult rc = wait_value(static_cast<CUstream>(stream), device_ptr_ + slot * sizeof(uint32_t),
                                 value, CU_STREAM_WAIT_VALUE_GEQ);
  if (rc != CUDA_SUCCESS) {
    release((uint64_t{slot} << 32) | value);
    P2P_THROW(ErrorKind::Generic, "cuStreamWaitValue32 failed with CUresult ", rc);
  }
  return (uint64_t{slot} << 32) | value;
}

void StreamFlags::release(uint64_t token) {
  const size_t slot = token >> 32;
  const uint32_t value = static_cast<uint32_t>(token);
  __atomic_store_n(&host_[slot], value, __ATOMIC_RELEASE);
  std::lock_guard<std::mutex> lock(mu_);
  free_.push_back(slot);
}

}  // namespace p2p::cuda
