// Engine: the torch-facing front of one Worker. Python threads call it; it validates tensors
// and views, decomposes them into byte runs and hands the work to the worker thread, so that
// bad input raises before anything is queued. It records the caller's CUDA stream position
// for transfers of GPU memory. csrc/bindings/ wraps it for Python; torch_p2p/engine.py adds
// futures, the dispatcher thread and the friendly signature.
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>
#include <string>
#include <vector>

#include "engine/completions.h"
#include "engine/futures.h"
#include "engine/remote_view.h"
#include "engine/worker.h"

namespace p2p::engine {

using namespace core;

// Page ids as calls take them: a strided, 1-d, contiguous int64 CPU tensor.
bool page_id_tensor(const at::Tensor& ids);
// Raises a Value error naming that form if `ids` is not in it.
void check_page_id_tensor(const at::Tensor& ids);
extern const char* const kPageIdForm;  // the form, as messages give it

class Engine {
 public:
  explicit Engine(Setup setup);
  ~Engine();

  const std::string& address() const { return worker_->facts().address; }
  const std::string& provider() const { return worker_->facts().provider; }
  std::string data_path() const;
  const std::vector<RailFacts>& rails() const { return worker_->facts().rails; }
  bool delivery_complete() const { return worker_->facts().delivery_complete; }
  bool auto_progress() const { return worker_->facts().auto_progress; }
  bool closed() const { return closed_; }

  // Registers the tensor's whole storage; returns the region id and a view of the tensor.
  std::pair<uint64_t, std::shared_ptr<RemoteView>> register_tensor(const at::Tensor& tensor,
                                                                    const std::string& access,
                                                                    double timeout_s);
  // Waits for operations using the region to finish, then deregisters it. No GIL needed.
  void deregister(uint64_t id, double timeout_s);

  // Pages of a view: view.select(dim, i) for each i in `ids` (int64, on the CPU), in order.
  using Pages = std::optional<std::tuple<at::Tensor, int64_t>>;  // (ids, dim); none: the whole view
  // write_slices (write=true) / read_slices. `remote` holds one view per local view, or one
  // view in mirror mode. An entry with pages on one side has them on the other (same count).
  // `id` names the completion. notify < 0: none.
  void submit(uint64_t id, bool write, const std::vector<at::Tensor>& local,
              const std::vector<std::shared_ptr<RemoteView>>& remote, const std::vector<Pages>& local_pages,
              const std::vector<Pages>& remote_pages, bool mirror, int64_t notify, double timeout_s);
  // A call checked and decomposed once, to run many times (prepare_write / prepare_read): each
  // run() moves the same bytes as a submit() of the same arguments would, after the caller's
  // stream work of that moment, and fails if a region of this engine that it uses has been
  // deregistered.
  struct Prepared {
    TransferCall call;
    bool cuda = false;  // a run follows the caller's stream
    // Where every page entry is a page list and all share one copy of the ids (a KV cache's
    // layers), the bounds of those ids: a run may then move other pages (run_pages). -1: not so.
    int64_t lcount = -1, rcount = -1;
  };
  std::shared_ptr<Prepared> prepare(bool write, const std::vector<at::Tensor>& local,
                                    const std::vector<std::shared_ptr<RemoteView>>& remote,
                                    const std::vector<Pages>& local_pages, const std::vector<Pages>& remote_pages,
                                    bool mirror, int64_t notify, double timeout_s);
  void run(uint64_t id, const Prepared& prepared);
  // A run with other page ids (n local, n remote, n > 0; int64 CPU, 1-d, contiguous), checked
  // as a call checks them, and `notify` (< 0: the prepared call's) in place of the prepared ones.
  void run_pages(uint64_t id, const Prepared& prepared, const at::Tensor& lids, const at::Tensor& rids,
                 int64_t notify);
  // "ipc", "direct" or "staged": see Worker::route.
  std::string route(const std::string& address, const std::shared_ptr<RemoteView>& view);
  void connect(uint64_t id, const std::string& address);
  void disconnect(uint64_t id, const std::string& address);
  void send(uint64_t id, const std::string& address, std::string payload, double timeout_s);
  void recv(uint64_t id, double timeout_s);
  void notification(uint64_t id, uint32_t tag, double timeout_s);

  // Operations complete the torch future their call made: expect() takes it (and the handle
  // on its Python object, which the bindings own) into the table of futures and returns the
  // operation's id; forget() gives the handle back when the operation could not start.
  uint64_t expect(TorchFutures::Future future, TorchFutures::Handle handle) {
    return futures_.add(std::move(future), handle);
  }
  TorchFutures::Handle forget(uint64_t id) { return futures_.drop(id); }
  // Fails `future` with CancelledError if it is an operation of ours in flight.
  void cancel(const TorchFutures::Future& future);
  // A completion Python must see (an error, a received message), with its future's handle.
  struct ForPython {
    Completion completion;
    TorchFutures::Handle future;
  };
  // Waits up to timeout_ms for completions Python must see, while completing successes here;
  // `released` collects the handles of those. Returns early with `released` once it holds
  // 4096 handles or its first is 10 ms old, so that the bindings (which drop those handles with
  // the GIL) take the GIL about a hundred times a second at most rather than once per
  // completion: that GIL traffic slowed the threads that submit. `out` and `released` are
  // empty before.
  void poll(int timeout_ms, std::vector<ForPython>& out, std::vector<TorchFutures::Handle>& released);
  // How long the dispatcher and waiters spin for a completion before they sleep: 0 unless the
  // worker is pinned (owns its core and busy-polls); on a host of few cores spinning threads
  // starve each other.
  int completion_spin_us() const;
  // Every handle the table still holds, the table then empty: once the dispatcher has stopped.
  std::vector<TorchFutures::Handle> take_futures() { return futures_.take_all(); }
  size_t futures_held() { return futures_.held(); }
  bool drained() { return completions_.closed(); }
  void close();

  // Makes `stream` follow `future`: a call of ours on the IPC route through an event recorded
  // after its copy, on the GPU (this returns once the copy is queued); anything else by
  // waiting here, on the host, until the future completes or fails. No GIL needed.
  void stream_wait(void* stream, const TorchFutures::Future& future);

 private:
  // NOTE: PyTorch takes the GIL when a tensor that Python also holds gains its first or loses its
  // last C++ reference, and submit() takes mu_ with the GIL held: a LocalRegion is created and
  // destroyed outside mu_, or the two threads wait for each other forever (deregister()
  // racing write_slices() hangs).
  struct LocalRegion {
    uint64_t id;
    uintptr_t start, end;
    at::Tensor tensor;  // keeps the storage alive while registered
    bool closed = false;
  };
  void reserve(uintptr_t start, uintptr_t end, const at::Tensor& tensor);
  const LocalRegion& region_of(const at::Tensor& view, uint64_t extent, const char* what, size_t index);
  // Entry `index` of a call: checks it and adds its runs or pages to t; false if it moves nothing.
  struct Entry {
    size_t index;
    const at::Tensor& view;
    const RemoteView& remote;
    const char* what;  // "source view" or "destination view"
    bool write;
  };
  // The last page entry of a call whose ids were copied and checked (page_ids from `first`: n
  // local, then n remote) and kept: the next entry with the same ids and bounds shares them.
  struct PageIdCheck {
    size_t first = 0;
    int64_t n = -1, lcount = 0, rcount = 0;
  };
  // Checks a call's arguments and decomposes them into t; true if it moves CUDA memory.
  // With `one_list`, the bounds of the call's page ids where they are one shared list (Prepared).
  bool build(TransferCall& t, bool write, const std::vector<at::Tensor>& local,
             const std::vector<std::shared_ptr<RemoteView>>& remote, const std::vector<Pages>& local_pages,
             const std::vector<Pages>& remote_pages, bool mirror, int64_t notify, double timeout_s,
             PageIdCheck* one_list = nullptr);
  // Gives t its id and stream event and hands it to the worker, unless it is copied here.
  void start(uint64_t id, std::unique_ptr<Transfer> t, bool cuda);
  // The prepared call's copy, its regions still open (mu_ held).
  std::unique_ptr<Transfer> copy_of(const Prepared& prepared);
  // Region `region` of this engine is registered and not closing (mu_ held).
  bool open(uint64_t region) const;
  // Copies t on this thread if it can (core/caller_copies.h) and completes its future: true
  // then, and t is given back.
  bool copied_here(uint64_t id, std::unique_ptr<Transfer>& t);
  bool add_pages(TransferCall& t, const Entry& e, bool mirror, const Pages& local_pages, const Pages& remote_pages,
                 PageIdCheck& checked);
  // Checks page ids (n local, then n remote) of entry `index`: in range, and no destination
  // page twice.
  void check_page_ids(const int64_t* lids, int64_t n, int64_t lcount, int64_t rcount, const char* what,
                      size_t index, bool write);
  bool add_view(TransferCall& t, const Entry& e, bool mirror);
  // Adds entry i's pages to t: local page k at lbase + lids[k] * lstride, remote page k at
  // rbase + rids[k] * rstride (bytes), page shape and strides as given.
  struct PageSide {
    uint64_t base;
    int64_t stride;  // bytes between pages
    const int64_t* ids;
    Dims strides;  // of a page, in elements (inline: a call may hold an entry per layer)
  };
  // Adds the pages (ids at page_ids[first..]) as one page list, or as runs when a page is not
  // one run on both sides: false then (the ids are not needed).
  static bool append_pages(Ints shape, const PageSide& local, const PageSide& remote,
                           int64_t n, int64_t elem, uint32_t lreg, uint32_t rreg, size_t first, TransferCall& t);
  void check_device(const at::Tensor& t, const char* what) const;
  void post(Command command);
  void enqueue(std::unique_ptr<Transfer> t);

  CompletionQueue completions_;
  TorchFutures futures_;
  std::vector<Completion> popped_;  // poll()'s buffer, kept for its capacity (dispatcher only)
  TransferPool transfers_;  // the worker gives finished transfers back
  std::unique_ptr<Worker> worker_;
  int cuda_device_;
  std::mutex mu_;
  std::map<uintptr_t, LocalRegion> regions_;  // by start address
  std::vector<uint8_t> taken_;                 // check_page_ids' table (repeated_id), zero between calls
  bool closed_ = false;
};

}  // namespace p2p::engine
