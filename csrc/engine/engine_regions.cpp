// The engine's side of registration: the table of local regions (by address) that transfers
// look their tensors up in, and the calls that fill and empty it through the worker.
#include <algorithm>

#include "engine/engine.h"

#ifdef WITH_CUDA
#include <c10/cuda/CUDAGuard.h>

#include "cuda/device.h"
#endif

namespace p2p::engine {

using namespace core;
namespace {

uint8_t parse_access(const std::string& access) {
  if (access == "rw" || access == "wr") return kRemoteRead | kRemoteWrite;
  if (access == "r") return kRemoteRead;
  if (access == "w") return kRemoteWrite;
  P2P_THROW(ErrorKind::Value, "access must be 'rw', 'r' or 'w', not '", access, "'");
}

std::shared_ptr<RemoteView> view_of(const at::Tensor& tensor, std::shared_ptr<RemoteRegion> region) {
  auto view = std::make_shared<RemoteView>();
  view->region = std::move(region);
  view->dtype = tensor.scalar_type();
  view->shape.assign(tensor.sizes().begin(), tensor.sizes().end());
  view->strides.assign(tensor.strides().begin(), tensor.strides().end());
  view->offset = tensor.storage_offset();
  return view;
}

}  // namespace

// Reserves [start, end): closed to transfers until the worker has registered it and named it.
void Engine::reserve(uintptr_t start, uintptr_t end, const at::Tensor& tensor) {
  LocalRegion reservation{0, start, end, tensor, true};
  std::lock_guard<std::mutex> lock(mu_);
  P2P_CHECK(!closed_, ErrorKind::Closed, "the engine is closed");
  auto next = regions_.lower_bound(start);
  const bool overlaps_next = next != regions_.end() && next->first < end;
  const bool overlaps_prev = next != regions_.begin() && std::prev(next)->second.end > start;
  if (overlaps_next || overlaps_prev) {
    const LocalRegion& other = overlaps_next ? next->second : std::prev(next)->second;
    P2P_THROW(ErrorKind::Value, "this tensor's storage overlaps region ", other.id,
              ", registered already; use views of that region's RemoteTensor instead");
  }
  regions_.emplace(start, std::move(reservation));
}

std::pair<uint64_t, std::shared_ptr<RemoteView>> Engine::register_tensor(const at::Tensor& tensor,
                                                                          const std::string& access,
                                                                          double timeout_s) {
  check_device(tensor, "the tensor to register");
  const uint8_t bits = parse_access(access);
  const at::Storage& storage = tensor.storage();
  auto* ptr = static_cast<uint8_t*>(storage.mutable_data());
  const uint64_t nbytes = storage.nbytes();
  P2P_CHECK(ptr && nbytes > 0, ErrorKind::Value, "cannot register a tensor with an empty storage");
  const uintptr_t start = reinterpret_cast<uintptr_t>(ptr), end = start + nbytes;
  reserve(start, end, tensor);
  auto unreserve = [&] {
    decltype(regions_)::node_type gone;
    std::lock_guard<std::mutex> lock(mu_);
    gone = regions_.extract(start);
  };
  const int device = tensor.is_cuda() ? tensor.get_device() : -1;
  Worker::RegionSpec spec{ptr, nbytes, device, bits, storage.unsafeGetStorageImpl()};
#ifdef WITH_CUDA
  if (device >= 0) {
    // The driver looks pointers up in the current context: the caller's may be another GPU's.
    const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    spec.vmm = cuda::is_vmm_memory(ptr);
  }
#endif
  std::shared_ptr<RemoteRegion> region;
  try {
    // The call holds the storage: the routes read it even if the wait times out here.
    region = worker_->call<std::shared_ptr<RemoteRegion>>(
        [spec, held = storage](Worker& w) { return w.register_region(spec); }, timeout_s);
  } catch (const Error& e) {
    unreserve();
    if (spec.vmm && e.kind() == ErrorKind::Generic)
      P2P_THROW(ErrorKind::Value, e.what(), ". This tensor lives in CUDA VMM memory (PyTorch's "
                "expandable segments), which provider ", provider(), " cannot register here, and data_path='direct' "
                "keeps it from the staging slots that take it otherwise: create the engine with data_path='auto' "
                "(the default) or 'staged', or set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False");
    throw;
  } catch (...) {
    unreserve();
    throw;
  }
  const uint64_t id = region->id;
  std::shared_ptr<RemoteView> view = view_of(tensor, std::move(region));
  std::lock_guard<std::mutex> lock(mu_);
  LocalRegion& reserved = regions_.at(start);
  reserved.id = id;
  reserved.closed = false;
  return {id, view};
}

void Engine::deregister(uint64_t id, double timeout_s) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = std::find_if(regions_.begin(), regions_.end(), [&](auto& kv) { return kv.second.id == id; });
    if (it == regions_.end() || closed_) return;  // already gone
    it->second.closed = true;  // a retry after a timeout finds it closed and waits again
  }
  auto done = std::make_shared<std::promise<void>>();
  auto finished = done->get_future();
  worker_->call<void>([id, done](Worker& w) { w.deregister_region(id, done); }, timeout_s);
  if (finished.wait_for(std::chrono::duration<double>(timeout_s)) != std::future_status::ready)
    P2P_THROW(ErrorKind::Timeout, "region ", id, " is still used by operations in flight after ",
              timeout_s, " s; it stays closed to new operations");
  decltype(regions_)::node_type gone;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = regions_.begin(); it != regions_.end(); ++it) {
    if (it->second.id != id) continue;
    gone = regions_.extract(it);
    break;
  }
}

const Engine::LocalRegion& Engine::region_of(const at::Tensor& view, uint64_t extent, const char* what,
                                             size_t index) {
  const uintptr_t start = reinterpret_cast<uintptr_t>(view.data_ptr());
  auto it = regions_.upper_bound(start);
  if (it != regions_.begin()) {
    const LocalRegion& r = (--it)->second;
    if (start >= r.start && start + extent <= r.end) {
      P2P_CHECK(!r.closed, ErrorKind::Closed, what, " ", index, " lies in region ", r.id,
                ", which is being deregistered");
      return r;
    }
  }
  P2P_THROW(ErrorKind::Value, what, " ", index, " is not inside a tensor registered with this engine "
            "(register the tensor, or a tensor whose storage holds it, first)");
}

}  // namespace p2p::engine
