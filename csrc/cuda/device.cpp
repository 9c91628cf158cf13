#include "cuda/device.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <mutex>
#include <vector>

#include "common/error.h"

#if CUDART_VERSION < 12000
#error "torch_p2p's CUDA sources need CUDA 12.0 or newer (set WITH_CUDA=0 for a build without CUDA)"
#endif

namespace p2p::cuda {
namespace {

// Makes `device` current for a scope; no runtime call to switch when it already is (the
// usual case: every transfer's stream event goes through here).
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    cudaGetDevice(&previous_);
    if (previous_ != device) P2P_CUDA_CHECK(cudaSetDevice(device), "cudaSetDevice");
    else previous_ = -1;
  }
  ~DeviceScope() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }

 private:
  int previous_ = -1;
};

}  // namespace

void* driver_function(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found;
#if CUDART_VERSION >= 12050
  const cudaError_t rc = cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found);
#else  // CUDA 12.0-12.4: the function's version is the toolkit's, 12.0 or later
  const cudaError_t rc = cudaGetDriverEntryPoint(name, &fn, cudaEnableDefault, &found);
#endif
  if (rc != cudaSuccess || found != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return fn;
}

bool is_vmm_memory(const void* ptr) {
  using Retain = CUresult (*)(CUmemGenericAllocationHandle*, void*);
  using Release = CUresult (*)(CUmemGenericAllocationHandle);
  static const auto retain = reinterpret_cast<Retain>(driver_function("cuMemRetainAllocationHandle"));
  static const auto release = reinterpret_cast<Release>(driver_function("cuMemRelease"));
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
  P2P_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate");
  return ev;
}

bool idle(void* stream) {
  const cudaError_t rc = cudaStreamQuery(static_cast<cudaStream_t>(stream));
  if (rc == cudaSuccess) return true;
  if (rc != cudaErrorNotReady) cudaGetLastError();  // record_event says what is wrong
  return false;
}

void* record_event(int device, void* stream) {
  auto ev = static_cast<cudaEvent_t>(take_event(device));
  DeviceScope scope(device);
  const cudaError_t rc = cudaEventRecord(ev, static_cast<cudaStream_t>(stream));
  if (rc != cudaSuccess) {
    cudaEventDestroy(ev);
    P2P_CUDA_CHECK(rc, "cudaEventRecord");
  }
  return ev;
}

void recycle_event(int device, void* event) {
  std::lock_guard<std::mutex> lock(events_mu);
  if (free_events.size() <= static_cast<size_t>(device)) free_events.resize(device + 1);
  free_events[device].push_back(static_cast<cudaEvent_t>(event));
}

void wait_event(int device, void* stream, void* event) {
  const cudaError_t rc = cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event), 0);
  recycle_event(device, event);
  P2P_CUDA_CHECK(rc, "cudaStreamWaitEvent");
}

}  // namespace p2p::cuda
