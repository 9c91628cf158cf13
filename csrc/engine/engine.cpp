#include "engine/engine.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "common/log.h"

#ifdef WITH_CUDA
#include <c10/cuda/CUDAStream.h>

#include "cuda/device.h"
#endif

namespace p2p::engine {

using namespace core;
namespace {

// How long the dispatcher (while operations are in flight) and a thread waiting on a future of
// a pinned engine (whose worker owns a core of a host with cores to spare) spin before they
// sleep: a small call's whole life is shorter, and a thread woken from a sleep costs about as
// much as the call (futex wake-ups, more on a VM's idle core).
constexpr int kCompletionSpinUs = 200;

std::string dims(at::IntArrayRef v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

}  // namespace

Engine::Engine(Setup setup) : cuda_device_(setup.config.cuda_device) {
  worker_ = std::make_unique<Worker>(std::move(setup), &completions_, &transfers_);
}

Engine::~Engine() { close(); }

std::string Engine::data_path() const {
  return worker_->facts().off_nics ? "staged" : "direct";
}

void Engine::close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    closed_ = true;
  }
  worker_->stop();
  completions_.close();
  decltype(regions_) gone;  // released after the lock (see LocalRegion)
  std::lock_guard<std::mutex> lock(mu_);
  gone.swap(regions_);
}

void Engine::post(Command command) {
  P2P_CHECK(!closed_, ErrorKind::Closed, "the engine is closed");
  worker_->post(std::move(command));
}

void Engine::check_device(const at::Tensor& t, const char* what) const {
  P2P_CHECK(t.defined(), ErrorKind::Value, what, " is an undefined tensor");
  P2P_CHECK(t.layout() == at::kStrided, ErrorKind::Value, what, " must be a strided (dense) tensor");
  if (t.is_cuda()) {
    P2P_CHECK(t.get_device() == cuda_device_, ErrorKind::Value, what, " is on cuda:", t.get_device(),
              " but this engine serves ",
              cuda_device_ >= 0 ? "cuda:" + std::to_string(cuda_device_) : std::string("the host only"));
  } else {
    P2P_CHECK(t.is_cpu(), ErrorKind::Value, what, " must be a CPU or CUDA tensor, not ", t.device().str());
  }
}

void Engine::submit(uint64_t id, bool write, const std::vector<at::Tensor>& local,
                    const std::vector<std::shared_ptr<RemoteView>>& remote, const std::vector<Pages>& local_pages,
                    const std::vector<Pages>& remote_pages, bool mirror, int64_t notify, double timeout_s) {
  auto t = transfers_.take();
  const bool cuda = build(*t, write, local, remote, local_pages, remote_pages, mirror, notify, timeout_s);
  start(id, std::move(t), cuda);
}

bool Engine::copied_here(uint64_t id, std::unique_ptr<Transfer>& t) {
  if (!worker_->caller_copies().move(*t)) return false;
  TorchFutures::Handle handle;
  futures_.complete(Completion{id, Status{}, {}, {}}, handle);  // the dispatcher drops the handle later
  transfers_.give(std::move(t));
  return true;
}

std::shared_ptr<Engine::Prepared> Engine::prepare(bool write, const std::vector<at::Tensor>& local,
                                                   const std::vector<std::shared_ptr<RemoteView>>& remote,
                                                   const std::vector<Pages>& local_pages,
                                                   const std::vector<Pages>& remote_pages, bool mirror, int64_t notify,
                                                   double timeout_s) {
  auto p = std::make_shared<Prepared>();
  PageIdCheck one_list;
  p->cuda = build(p->call, write, local, remote, local_pages, remote_pages, mirror, notify, timeout_s, &one_list);
  if (one_list.n >= 0) {
    p->lcount = one_list.lcount;
    p->rcount = one_list.rcount;
  }
  return p;
}

std::unique_ptr<Transfer> Engine::copy_of(const Prepared& prepared) {
  // The checks were made once; a region deregistered since then fails the run here (or, if
  // it goes meanwhile, in the worker, which resolves every region id again).
  P2P_CHECK(!closed_, ErrorKind::Closed, "the engine is closed");
  for (uint64_t rid : prepared.call.local_ids)
    P2P_CHECK(open(rid), ErrorKind::Closed, "region ", rid, " of this prepared call is deregistered");
  for (const auto& r : prepared.call.remote)
    P2P_CHECK(r->owner != address() || open(r->id), ErrorKind::Closed, "region ", r->id,
              " of this prepared call is deregistered");
  auto t = transfers_.take();
  static_cast<TransferCall&>(*t) = prepared.call;
  return t;
}

void Engine::run(uint64_t id, const Prepared& prepared) {
  std::unique_ptr<Transfer> t;
  {
    std::lock_guard<std::mutex> lock(mu_);
    t = copy_of(prepared);
  }
  start(id, std::move(t), prepared.cuda);
}

const char* const kPageIdForm = "page ids must be a 1-d contiguous int64 CPU tensor";

bool page_id_tensor(const at::Tensor& ids) {
  return ids.layout() == at::kStrided && ids.scalar_type() == at::kLong && ids.is_cpu() && ids.dim() == 1 &&
         ids.is_contiguous();
}

void check_page_id_tensor(const at::Tensor& ids) { P2P_CHECK(page_id_tensor(ids), ErrorKind::Value, kPageIdForm); }

void Engine::run_pages(uint64_t id, const Prepared& prepared, const at::Tensor& lids, const at::Tensor& rids,
                       int64_t notify) {
  P2P_CHECK(prepared.lcount >= 0, ErrorKind::Value, "this prepared call takes no other page ids: its page "
            "entries must all be p2p.pages of dense pages sharing one list of ids (a KV cache's layers)");
  check_page_id_tensor(lids);
  check_page_id_tensor(rids);
  const int64_t n = lids.numel();
  P2P_CHECK(n == rids.numel(), ErrorKind::Value, n, " local page ids but ", rids.numel(), " remote ones");
  P2P_CHECK(n > 0, ErrorKind::Value, "no page ids");
  const bool write = prepared.call.kind == TransferKind::Write;
  std::unique_ptr<Transfer> t;
  {
    std::lock_guard<std::mutex> lock(mu_);
    t = copy_of(prepared);
    const int64_t* lp = lids.data_ptr<int64_t>();
    const int64_t* rp = rids.data_ptr<int64_t>();
    t->page_ids.assign(lp, lp + n);
    t->page_ids.insert(t->page_ids.end(), rp, rp + n);
    try {
      check_page_ids(t->page_ids.data(), n, prepared.lcount, prepared.rcount,
                     write ? "source view" : "destination view", 0, write);
    } catch (...) {
      transfers_.give(std::move(t));
      throw;
    }
  }
  for (PageRuns& p : t->pages) p.n = static_cast<size_t>(n);  // every list starts at page_ids[0]
  if (notify >= 0) {
    t->notify = true;
    t->tag = static_cast<uint32_t>(notify);
  }
  start(id, std::move(t), prepared.cuda);
}

bool Engine::open(uint64_t region) const {
  return std::any_of(regions_.begin(), regions_.end(), [&](auto& kv) { return kv.second.id == region && !kv.second.closed; });
}

void Engine::start(uint64_t id, std::unique_ptr<Transfer> t, bool cuda) {
  t->id = id;
  if (!cuda && copied_here(id, t)) return;
#ifdef WITH_CUDA
  if (cuda) {
    // The transfer follows the work queued so far on the caller's current stream: nothing to
    // follow if all of it is done (then no event, and no wait for one on the worker).
    void* stream = c10::cuda::getCurrentCUDAStream(cuda_device_).stream();
    if (!cuda::idle(stream)) t->cuda_event = cuda::record_event(cuda_device_, stream);
  }
#endif
  enqueue(std::move(t));
}

bool Engine::build(TransferCall& t, bool write, const std::vector<at::Tensor>& local,
                   const std::vector<std::shared_ptr<RemoteView>>& remote, const std::vector<Pages>& local_pages,
                   const std::vector<Pages>& remote_pages, bool mirror, int64_t notify, double timeout_s,
                   PageIdCheck* one_list) {
  const char* what = write ? "source view" : "destination view";
  P2P_CHECK(!remote.empty() && remote[0], ErrorKind::Value, "no RemoteTensor given");
  P2P_CHECK(mirror ? remote.size() == 1 : remote.size() == local.size(), ErrorKind::Value,
            "expected one RemoteTensor per local view (", local.size(), " local views, ", remote.size(),
            " RemoteTensors)");
  P2P_CHECK(local_pages.size() == local.size() && remote_pages.size() == remote.size(), ErrorKind::Value,
            "one page list (or None) per view");
  const std::string& owner = remote[0]->region->owner;

  t.kind = write ? TransferKind::Write : TransferKind::Read;
  t.peer_address = owner;
  t.notify = notify >= 0;
  t.tag = static_cast<uint32_t>(std::max<int64_t>(notify, 0));
  t.timeout_s = timeout_s;
  // One allocation for the call's page ids; an entry with the previous entry's id tensors (a
  // KV cache's next layer) usually shares its copy (add_pages).
  size_t ids = 0;
  const void* last_ids[2] = {nullptr, nullptr};
  for (size_t i = 0; i < local.size(); ++i) {
    const Pages& l = local_pages[i];
    const Pages& r = remote_pages[mirror ? 0 : i];
    if (!l || !r) continue;
    const void* these[2] = {std::get<0>(*l).data_ptr(), std::get<0>(*r).data_ptr()};
    if (these[0] != last_ids[0] || these[1] != last_ids[1]) ids += 2 * std::get<0>(*l).numel();
    last_ids[0] = these[0];
    last_ids[1] = these[1];
  }
  t.page_ids.reserve(ids);
  bool cuda = false;
  PageIdCheck checked;
  std::lock_guard<std::mutex> lock(mu_);
  P2P_CHECK(!closed_, ErrorKind::Closed, "the engine is closed");
  for (size_t i = 0; i < local.size(); ++i) {
    const Entry e{i, local[i], *remote[mirror ? 0 : i], what, write};
    check_device(e.view, what);
    const RemoteRegion& rr = *e.remote.region;
    P2P_CHECK(rr.owner == owner, ErrorKind::Value, "all RemoteTensors of one call must belong to one "
              "peer; RemoteTensor ", i, " belongs to another");
    // Our own region: we know whether it is still there.
    P2P_CHECK(rr.owner != address() || open(rr.id), ErrorKind::Closed, "RemoteTensor ", i,
              " names region ", rr.id, " of this engine, which is deregistered");
    const bool added = local_pages[i] || remote_pages[mirror ? 0 : i]
                           ? add_pages(t, e, mirror, local_pages[i], remote_pages[mirror ? 0 : i], checked)
                           : add_view(t, e, mirror);
    cuda |= added && e.view.is_cuda();
  }
  if (one_list) {
    // One list: each page entry became a page list (none turned into runs, none empty), all
    // sharing the one copy of the ids.
    const size_t page_entries = std::count_if(local_pages.begin(), local_pages.end(), [](const Pages& p) { return p.has_value(); });
    if (checked.n > 0 && t.pages.size() == page_entries && t.page_ids.size() == 2 * static_cast<size_t>(checked.n))
      *one_list = checked;
  }
  return cuda;
}

namespace {

void check_access(const RemoteRegion& rr, bool write) {
  P2P_CHECK(rr.access & (write ? kRemoteWrite : kRemoteRead), ErrorKind::Value, "region ", rr.id,
            " of the peer does not accept remote ", write ? "writes (registered with access='r')"
                                                          : "reads (registered with access='w')");
}

// The indexes of a local and a remote region in t's lists, added if new.
std::pair<uint32_t, uint32_t> region_indexes(TransferCall& t, uint64_t local, const std::shared_ptr<const RemoteRegion>& remote) {
  auto l = std::find(t.local_ids.begin(), t.local_ids.end(), local) - t.local_ids.begin();
  if (static_cast<size_t>(l) == t.local_ids.size()) t.local_ids.push_back(local);
  auto r = std::find(t.remote.begin(), t.remote.end(), remote) - t.remote.begin();
  if (static_cast<size_t>(r) == t.remote.size()) t.remote.push_back(remote);
  return {static_cast<uint32_t>(l), static_cast<uint32_t>(r)};
}

// A page of `shape` with these strides (elements) is one run of bytes: dense in row-major
// order, dimensions of size 1 aside.
bool dense(Ints shape, Ints strides) {
  int64_t expected = 1;
  for (size_t d = shape.size(); d-- > 0;) {
    if (shape[d] == 1) continue;
    if (strides[d] != expected) return false;
    expected *= shape[d];
  }
  return true;
}

}  // namespace

bool Engine::add_pages(TransferCall& t, const Entry& e, bool mirror, const Pages& local_pages, const Pages& remote_pages,
                       PageIdCheck& checked) {
  const at::Tensor& v = e.view;
  const RemoteView& rv = e.remote;
  const char* what = e.what;
  const size_t i = e.index;
  P2P_CHECK(!mirror && local_pages && remote_pages, ErrorKind::Value, what, " ", i,
            ": pages pair with pages (p2p.pages on both sides, no mirror mode)");
  const auto& [lids, ldim] = *local_pages;
  const auto& [rids, rdim] = *remote_pages;
  check_page_id_tensor(lids);
  check_page_id_tensor(rids);
  P2P_CHECK(ldim >= 0 && ldim < v.dim() && rdim >= 0 && rdim < static_cast<int64_t>(rv.shape.size()),
            ErrorKind::Index, what, " ", i, ": the page dimension is out of range");
  P2P_CHECK(lids.numel() == rids.numel(), ErrorKind::Value, what, " ", i, " has ", lids.numel(),
            " pages but its RemoteTensor has ", rids.numel());
  Dims page(v.sizes().begin(), v.sizes().end()), rpage(rv.shape.begin(), rv.shape.end());
  page.erase(page.begin() + ldim);
  rpage.erase(rpage.begin() + rdim);
  P2P_CHECK(page == rpage, ErrorKind::Value, what, " ", i, ": a page has shape ", dims(page),
            " but a remote page has shape ", dims(rpage));
  P2P_CHECK(rv.dtype == v.scalar_type(), ErrorKind::Value, what, " ", i, " is ", c10::toString(v.scalar_type()),
            " but its RemoteTensor is ", c10::toString(rv.dtype));
  check_access(*rv.region, e.write);
  const int64_t n = lids.numel(), elem = v.element_size();
  if (n == 0 || v.numel() == 0) return false;
  const LocalRegion& lr = region_of(v, extent_bytes(v.sizes(), v.strides().data(), elem), what, i);
  PageSide ls{reinterpret_cast<uint64_t>(v.data_ptr()), v.stride(ldim) * elem, nullptr, {v.strides().begin(), v.strides().end()}};
  PageSide rs{static_cast<uint64_t>(rv.offset * elem), rv.strides[rdim] * elem, nullptr, {rv.strides.begin(), rv.strides.end()}};
  ls.strides.erase(ls.strides.begin() + ldim);
  rs.strides.erase(rs.strides.begin() + rdim);
  P2P_CHECK(!self_overlapping(page, (e.write ? rs : ls).strides.data()), ErrorKind::Value, what, " ", i,
            ": the destination pages have overlapping elements (a stride of 0?)");
  // The checks and the route read the transfer's own copy of the ids, which the caller cannot
  // change after the checks. An entry whose ids and bounds are the previous entry's (a KV
  // cache's next layer) shares that entry's checked copy.
  const int64_t lcount = v.size(ldim), rcount = rv.shape[rdim];
  const int64_t* lp = lids.data_ptr<int64_t>();
  const int64_t* rp = rids.data_ptr<int64_t>();
  const bool shared = checked.n == n && checked.lcount == lcount && checked.rcount == rcount &&
                      std::memcmp(lp, t.page_ids.data() + checked.first, n * sizeof(int64_t)) == 0 &&
                      std::memcmp(rp, t.page_ids.data() + checked.first + n, n * sizeof(int64_t)) == 0;
  const size_t first = shared ? checked.first : t.page_ids.size();
  if (!shared) {
    t.page_ids.insert(t.page_ids.end(), lp, lp + n);
    t.page_ids.insert(t.page_ids.end(), rp, rp + n);
    check_page_ids(t.page_ids.data() + first, n, lcount, rcount, e.what, e.index, e.write);
  }
  ls.ids = t.page_ids.data() + first;
  rs.ids = ls.ids + n;
  const auto [lidx, ridx] = region_indexes(t, lr.id, rv.region);
  if (append_pages(page, ls, rs, n, elem, lidx, ridx, first, t)) {
    if (!shared) checked = {first, n, lcount, rcount};
  } else if (!shared) {  // moved as runs: its copy of the ids goes
    t.page_ids.resize(first);
    checked = {};
  }
  return true;
}

void Engine::check_page_ids(const int64_t* lids, int64_t n, int64_t lcount, int64_t rcount, const char* what,
                            size_t index, bool write) {
  const int64_t* rids = lids + n;
  // One pass without branches (vectorized) tells whether any id is out of range; only then
  // does the loop below look for the first, to name it.
  bool out = false;
  for (int64_t k = 0; k < n; ++k)
    out |= (static_cast<uint64_t>(lids[k]) >= static_cast<uint64_t>(lcount)) |
           (static_cast<uint64_t>(rids[k]) >= static_cast<uint64_t>(rcount));
  for (int64_t k = 0; out && k < n; ++k) {
    const int64_t l = lids[k], r = rids[k];
    P2P_CHECK(l >= 0 && l < lcount && r >= 0 && r < rcount, ErrorKind::Index, what, " ", index, ": page ", k,
              " pairs local page ", l, " of ", lcount, " with remote page ", r, " of ", rcount);
  }
  const int64_t twice = repeated_id(write ? rids : lids, n, write ? rcount : lcount, taken_);
  P2P_CHECK(twice < 0, ErrorKind::Value, what, " ", index, ": destination page ", twice,
            " is named twice; the result would depend on arrival order");
}

bool Engine::add_view(TransferCall& t, const Entry& e, bool mirror) {
  const at::Tensor& v = e.view;
  const RemoteView& rv = e.remote;
  const char* what = e.what;
  const size_t i = e.index;
  const c10::IntArrayRef shape = v.sizes();
  if (v.numel() == 0) {  // moves nothing; torch gives empty views no data pointer to check
    P2P_CHECK(mirror || (c10::IntArrayRef(rv.shape) == shape && rv.dtype == v.scalar_type()), ErrorKind::Value, what,
              " ", i, " is empty but its RemoteTensor is not of the same shape and dtype");
    return false;
  }
  const int64_t elem = v.element_size();
  const LocalRegion& lr = region_of(v, extent_bytes(shape, v.strides().data(), elem), what, i);

  // Where the view lands remotely: the same element positions (mirror), or the given view.
  int64_t rbase;
  const int64_t* rstrides;
  if (mirror) {
    const at::Tensor& reg = lr.tensor;
    P2P_CHECK(rv.dtype == reg.scalar_type() && c10::IntArrayRef(rv.shape) == reg.sizes() && c10::IntArrayRef(rv.strides) == reg.strides(),
              ErrorKind::Value, "mirror mode needs the RemoteTensor laid out like the registered local "
              "tensor: remote ", dims(rv.shape), " strides ", dims(rv.strides), " ", c10::toString(rv.dtype),
              ", local ", dims(reg.sizes()), " strides ", dims(reg.strides()), " ", c10::toString(reg.scalar_type()));
    rbase = rv.offset * rv.elem() + (static_cast<int64_t>(reinterpret_cast<uintptr_t>(v.data_ptr())) -
                                     static_cast<int64_t>(reinterpret_cast<uintptr_t>(reg.data_ptr())));
    rstrides = v.strides().data();
  } else {
    P2P_CHECK(c10::IntArrayRef(rv.shape) == shape, ErrorKind::Value, what, " ", i, " has shape ", dims(v.sizes()),
              " but its RemoteTensor has shape ", dims(rv.shape));
    P2P_CHECK(rv.dtype == v.scalar_type(), ErrorKind::Value, what, " ", i, " is ", c10::toString(v.scalar_type()),
              " but its RemoteTensor is ", c10::toString(rv.dtype));
    rbase = rv.offset * elem;
    rstrides = rv.strides.data();
  }
  const RemoteRegion& rr = *rv.region;
  const uint64_t rextent = extent_bytes(shape, rstrides, elem);
  P2P_CHECK(rbase >= 0 && static_cast<uint64_t>(rbase) + rextent <= rr.nbytes, ErrorKind::Value, what, " ", i,
            " would reach bytes ", rbase, "..", rbase + static_cast<int64_t>(rextent), " of a remote region of ",
            rr.nbytes, " bytes");
  check_access(rr, e.write);
  // Two elements landing on one address would make the result depend on arrival order.
  P2P_CHECK(!self_overlapping(shape, e.write ? rstrides : v.strides().data()), ErrorKind::Value,
            what, " ", i, ": the destination has overlapping elements (a stride of 0?)");
  const auto [lidx, ridx] = region_indexes(t, lr.id, rv.region);
  append_runs(shape, Strided{reinterpret_cast<uint64_t>(v.data_ptr()), v.strides().data()},
              Strided{static_cast<uint64_t>(rbase), rstrides}, elem, lidx, ridx, t.runs);
  return true;
}

bool Engine::append_pages(Ints shape, const PageSide& local, const PageSide& remote,
                          int64_t n, int64_t elem, uint32_t lreg, uint32_t rreg, size_t first, TransferCall& t) {
  // A page that is one run on both sides (the usual KV block) stays a page: one entry and its
  // ids, expanded into runs by the worker only for a route that needs them.
  if (dense(shape, local.strides) && dense(shape, remote.strides)) {
    t.pages.push_back({local.base, local.stride, remote.base, remote.stride,
                       extent_bytes(shape, local.strides.data(), elem), first, static_cast<size_t>(n), lreg, rreg});
    return true;
  }
  auto at = [&](const PageSide& s, int64_t k) { return s.base + static_cast<uint64_t>(s.ids[k] * s.stride); };
  for (int64_t k = 0; k < n; ++k)
    append_runs(shape, Strided{at(local, k), local.strides.data()}, Strided{at(remote, k), remote.strides.data()},
                elem, lreg, rreg, t.runs);
  return false;
}

void Engine::poll(int timeout_ms, std::vector<ForPython>& out, std::vector<TorchFutures::Handle>& released) {
  using Clock = std::chrono::steady_clock;
  constexpr size_t kReleaseBatch = 4096;
  constexpr auto kReleaseFlush = std::chrono::milliseconds(10);
  const int spin_us = completion_spin_us();
  const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  Clock::time_point flush_at = deadline;
  while (true) {
    const auto until = std::min(deadline, flush_at);
    const auto wait = std::chrono::ceil<std::chrono::milliseconds>(until - Clock::now()).count();
    popped_.clear();
    completions_.pop(popped_, static_cast<int>(std::max<int64_t>(wait, 0)), futures_.in_flight() ? spin_us : 0);
    for (Completion& c : popped_) {
      TorchFutures::Handle handle;
      if (!futures_.complete(c, handle) && handle) out.push_back({std::move(c), handle});
    }
    const size_t before = released.size();
    futures_.released(released);
    if (before == 0 && !released.empty()) flush_at = Clock::now() + kReleaseFlush;
    const auto now = Clock::now();
    if (!out.empty() || completions_.closed() || released.size() >= kReleaseBatch || now >= flush_at ||
        now >= deadline)
      return;
  }
}

std::string Engine::route(const std::string& address, const std::shared_ptr<RemoteView>& view) {
  EngineAddress::decode(address);  // bad bytes raise here
  std::shared_ptr<const RemoteRegion> region = view ? view->region : nullptr;
  return worker_->call<std::string>([address, region](Worker& w) { return w.route(address, region.get()); },
                                    worker_->config().timeout_s);
}

void Engine::enqueue(std::unique_ptr<Transfer> t) { post(StartTransfer{std::move(t)}); }

void Engine::connect(uint64_t id, const std::string& address) {
  EngineAddress::decode(address);  // bad bytes raise here, not in a future
  post(Connect{id, address});
}

void Engine::disconnect(uint64_t id, const std::string& address) {
  EngineAddress::decode(address);
  post(Disconnect{id, address});
}

void Engine::send(uint64_t id, const std::string& address, std::string payload, double timeout_s) {
  EngineAddress::decode(address);
  P2P_CHECK(payload.size() <= kMaxUserMessageBytes, ErrorKind::Value, "a message may hold at most ", kMaxUserMessageBytes,
            " bytes, not ", payload.size());
  auto t = transfers_.take();
  t->id = id;
  t->kind = TransferKind::Message;
  t->peer_address = address;
  t->payload = std::move(payload);
  t->timeout_s = timeout_s;
  enqueue(std::move(t));
}

void Engine::recv(uint64_t id, double timeout_s) {
  post(Receive{id, timeout_s});
}

void Engine::notification(uint64_t id, uint32_t tag, double timeout_s) {
  post(AwaitNotification{id, tag, timeout_s});
}

int Engine::completion_spin_us() const { return worker_->config().spin_us < 0 ? kCompletionSpinUs : 0; }

void Engine::cancel(const TorchFutures::Future& future) {
  uint64_t id = 0;
  if (closed_ || !futures_.find(future, id)) return;
  worker_->post(Cancel{id});
}

void Engine::stream_wait(void* stream, const TorchFutures::Future& future) {
#ifdef WITH_CUDA
  P2P_CHECK(cuda_device_ >= 0, ErrorKind::Value, "stream waits need a CUDA engine");
  uint64_t id = 0;
  if (futures_.find(future, id)) {  // an operation of ours in flight: how to follow it
    auto answer = std::make_shared<std::promise<StreamOrder>>();
    auto order = answer->get_future();
    post(Call{[id, answer](Worker& w, bool closed) {
      if (closed) return answer->set_value({});
      w.stream_order(id, answer);
    }});
    StreamOrder o;
    try {
      o = order.get();
    } catch (const std::future_error&) {  // the worker stopped with it unanswered: it has ended
    }
    if (o.kind == StreamOrder::Done) return;
    if (o.kind == StreamOrder::Event) return cuda::wait_event(cuda_device_, stream, o.event);
  }
  // Anything else is waited for here, on the host: a stream that waited on a flag the host
  // releases could hold up what releases it (README, "stream_wait").
  future->wait();
#else
  (void)stream;
  (void)future;
  P2P_THROW(ErrorKind::Value, "torch_p2p was built without CUDA");
#endif
}

}  // namespace p2p::engine
