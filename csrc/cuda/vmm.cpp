#include "cuda/vmm.h"

#include <cuda.h>
#include <cuda_runtime.h>
#include <unistd.h>

#include "common/error.h"
#include "cuda/device.h"

namespace p2p::cuda {
namespace {

// A driver function by its cuda.h name, typed as cuda.h declares it (null where the driver
// lacks it).
template <typename F>
F* driver(const char* name) {
  return reinterpret_cast<F*>(driver_function(name));
}
#define P2P_DRIVER(fn) driver<decltype(fn)>(#fn)

std::string error_text(CUresult rc) {
  static auto* text = P2P_DRIVER(cuGetErrorString);
  const char* s = nullptr;
  if (text && text(rc, &s) == CUDA_SUCCESS && s) return s;
  return cat("CUresult ", static_cast<int>(rc));
}

// Calls `fn` (null: the driver lacks it) and says why it failed, or "".
template <typename Fn, typename... Args>
std::string call(Fn* fn, const char* name, Args... args) {
  if (!fn) return cat(name, ": not in this driver");
  const CUresult rc = fn(args...);
  return rc == CUDA_SUCCESS ? std::string() : cat(name, ": ", error_text(rc));
}

// A retained allocation handle, released at scope end.
class Retained {
 public:
  explicit Retained(uint64_t ptr) {
    static auto* retain = P2P_DRIVER(cuMemRetainAllocationHandle);
    why_ = call(retain, "cuMemRetainAllocationHandle", &handle_, reinterpret_cast<void*>(ptr));
  }
  ~Retained() {
    static auto* release = P2P_DRIVER(cuMemRelease);
    if (why_.empty() && release) release(handle_);
  }
  Retained(const Retained&) = delete;
  Retained& operator=(const Retained&) = delete;
  const std::string& why() const { return why_; }
  CUmemGenericAllocationHandle handle() const { return handle_; }

 private:
  CUmemGenericAllocationHandle handle_{};
  std::string why_;
};

}  // namespace

std::vector<VmmChunk> vmm_layout(uint64_t ptr, uint64_t nbytes, std::string& why) {
  static auto* range = P2P_DRIVER(cuMemGetAddressRange);
  static auto* properties = P2P_DRIVER(cuMemGetAllocationPropertiesFromHandle);
  std::vector<VmmChunk> chunks;
  for (uint64_t at = ptr; at < ptr + nbytes;) {
    CUdeviceptr base = 0;
    size_t size = 0;
    why = call(range, "cuMemGetAddressRange", &base, &size, static_cast<CUdeviceptr>(at));
    if (why.empty() && (size == 0 || (!chunks.empty() && base != at)))
      why = cat("the mappings under the storage are not back to back at byte ", at - ptr);
    Retained handle(at);
    if (why.empty()) why = handle.why();
    CUmemAllocationProp prop{};
    if (why.empty()) why = call(properties, "cuMemGetAllocationPropertiesFromHandle", &prop, handle.handle());
    if (why.empty() && !(prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
      why = "its allocation was not created exportable (no CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR among its "
            "requested handle types)";
    if (!why.empty()) return {};
    chunks.push_back({base, size, -1});
    at = base + size;
  }
  return chunks;
}

std::vector<VmmChunk> vmm_export(uint64_t ptr, uint64_t nbytes, std::string& why) {
  static auto* to_fd = P2P_DRIVER(cuMemExportToShareableHandle);
  std::vector<VmmChunk> chunks = vmm_layout(ptr, nbytes, why);
  for (VmmChunk& c : chunks) {
    Retained handle(c.base);
    why = handle.why();
    int fd = -1;
    if (why.empty())
      why = call(to_fd, "cuMemExportToShareableHandle", static_cast<void*>(&fd), handle.handle(),
                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0ull);
    if (!why.empty()) {
      for (VmmChunk& done : chunks)
        if (done.fd >= 0) close(done.fd);
      return {};
    }
    c.fd = fd;
  }
  return chunks;
}

uint64_t vmm_import(int device, std::vector<VmmChunk>& chunks) {
  static auto* import = P2P_DRIVER(cuMemImportFromShareableHandle);
  static auto* reserve = P2P_DRIVER(cuMemAddressReserve);
  static auto* map = P2P_DRIVER(cuMemMap);
  static auto* access = P2P_DRIVER(cuMemSetAccess);
  static auto* release = P2P_DRIVER(cuMemRelease);
  uint64_t total = 0;
  for (const VmmChunk& c : chunks) total += c.size;
  std::string why;
  CUdeviceptr base = 0;
  uint64_t mapped = 0;
  if (const cudaError_t rc = cudaSetDevice(device); rc != cudaSuccess) {  // the driver calls need its context
    cudaGetLastError();
    why = cat("cudaSetDevice: ", cudaGetErrorString(rc));
  }
  if (why.empty()) why = call(reserve, "cuMemAddressReserve", &base, static_cast<size_t>(total), size_t{0}, CUdeviceptr{0}, 0ull);
  for (VmmChunk& c : chunks) {
    CUmemGenericAllocationHandle h{};
    if (why.empty())
      why = call(import, "cuMemImportFromShareableHandle", &h, reinterpret_cast<void*>(static_cast<intptr_t>(c.fd)),
                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    close(c.fd);
    c.fd = -1;
    if (!why.empty()) continue;
    // The mapping holds the allocation from here on: the handle goes at once.
    why = call(map, "cuMemMap", base + mapped, static_cast<size_t>(c.size), size_t{0}, h, 0ull);
    release(h);
    if (why.empty()) mapped += c.size;
  }
  CUmemAccessDesc desc{};
  desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  desc.location.id = device;
  desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (why.empty()) why = call(access, "cuMemSetAccess", base, static_cast<size_t>(total), &desc, size_t{1});
  if (!why.empty()) {
    static auto* unmap = P2P_DRIVER(cuMemUnmap);
    static auto* free_range = P2P_DRIVER(cuMemAddressFree);
    if (mapped && unmap) unmap(base, mapped);
    if (base && free_range) free_range(base, total);
    P2P_THROW(ErrorKind::Generic, "mapping a peer's CUDA VMM memory: ", why);
  }
  return base;
}

void vmm_unmap(uint64_t base, uint64_t size) {
  static auto* unmap = P2P_DRIVER(cuMemUnmap);
  static auto* free_range = P2P_DRIVER(cuMemAddressFree);
  if (unmap) unmap(base, size);
  if (free_range) free_range(base, size);
}

int dmabuf_fd(uint64_t ptr, uint64_t len, uint64_t& start, uint64_t& size, std::string& why) {
  static auto* handle = P2P_DRIVER(cuMemGetHandleForAddressRange);
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  start = ptr / page * page;
  size = (ptr + len + page - 1) / page * page - start;
  int fd = -1;
  why = call(handle, "cuMemGetHandleForAddressRange", static_cast<void*>(&fd), static_cast<CUdeviceptr>(start),
             static_cast<size_t>(size), CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0ull);
  return why.empty() ? fd : -1;
}

}  // namespace p2p::cuda
