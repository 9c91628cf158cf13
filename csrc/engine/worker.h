// Worker: the progress thread of one engine (one GPU, or the host), and only its loop. Its
// parts keep their own state: the rails and their ops (core/rails.h), the peers (peers.h), the
// control channel (control_channel.h), the regions (core/region_table.h), user messages
// (inbox.h), the commands from Python threads (mailbox.h) and the routes (routes/registry.h),
// which move every transfer's bytes. The worker keeps the transfers and ties the parts together.
//
// Thread model
//  - Python threads call only post(), call() and the const accessors of facts fixed at
//    start-up. Everything else runs on the worker thread.
//  - The worker never takes the GIL: results leave through the CompletionQueue.
//  - The loop: read every rail's CQ in batches, let the routes make progress (the fabric
//    route turns its queued transfers into ops, bounded by the op pool), post the ops in
//    batches with FI_MORE (lazy posting: requeue at the front on -FI_EAGAIN), check timers;
//    sleep on the CQ wait fds (or back off) only after spin_us without work.
#pragma once

#include <atomic>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/caller_copies.h"
#include "core/config.h"
#include "core/copier.h"
#include "core/messages.h"
#include "core/ops.h"
#include "core/peer.h"
#include "core/rails.h"
#include "core/region.h"
#include "core/region_table.h"
#include "core/route.h"
#include "core/transfer.h"
#include "engine/commands.h"
#include "engine/completions.h"
#include "engine/control_channel.h"
#include "engine/inbox.h"
#include "engine/live_transfers.h"
#include "engine/mailbox.h"
#include "engine/peers.h"
#include "fabric/info.h"

namespace p2p::engine {

using namespace core;

class Worker final : public RouteHost, OpSink, PeerEvents {
 public:
  // Finished transfers go back to `transfers` (the engine's).
  Worker(Setup setup, CompletionQueue* completions, TransferPool* transfers);
  ~Worker() override;
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // Python threads --------------------------------------------------------------------------
  // Queues a command (commands.h). Throws ClosedError once the worker has stopped.
  void post(Command command) { mailbox_.post(std::move(command)); }
  // Runs fn on the worker and waits up to timeout_s for its result (exceptions propagate).
  template <typename R>
  R call(std::function<R(Worker&)> fn, double timeout_s);
  // Fails everything in flight with ClosedError, says goodbye to peers, joins the thread.
  void stop();

  // Fixed once the thread has opened its rails.
  struct Facts {
    std::string address;  // EngineAddress, encoded
    uint64_t incarnation = 0;
    std::string provider;
    std::string host;  // host_identity()
    bool hmem = false;
    bool dmabuf = false;  // FI_MR_DMABUF offered (fabric/registration.h)
    bool off_nics = false;  // a route keeps this engine's own memory off the NICs (Route::keeps_off_nics)
    bool delivery_complete = false;
    bool auto_progress = false;
    std::vector<RailFacts> rails;
  };
  const Facts& facts() const { return facts_; }
  const Config& config() const override { return config_; }
  CallerCopies& caller_copies() override { return caller_copies_; }

  // Worker thread ---------------------------------------------------------------------------
  // Everything below runs on the worker thread only; the entry points that commands, op
  // owners and the loop reach first check it with assert_on_worker().
  void assert_on_worker() const { P2P_ASSERT(std::this_thread::get_id() == worker_thread_); }
  struct RegionSpec {
    uint8_t* ptr;
    uint64_t nbytes;
    int cuda_device;
    uint8_t access;
    const c10::StorageImpl* storage;  // the tensor's, for Route::learn
    bool vmm = false;  // CUDA VMM memory: where the NICs refuse it, the staging slots take it
  };
  std::shared_ptr<RemoteRegion> register_region(const RegionSpec& spec);
  Rails::DmaBufOf dmabuf_of(const RegionSpec& spec);
  void deregister_region(uint64_t id, std::shared_ptr<std::promise<void>> done);
  void start(Transfer* t);
  void cancel(uint64_t id);
  // Answers what a stream must wait on to follow transfer `id`: at once, or once the transfer
  // has taken its route (it may wait for its peer first).
  void stream_order(uint64_t id, StreamOrderAnswer answer);
  // A route's name, or "direct": how a transfer of this engine's memory to the owner of
  // `address` (and of `region`, if given) moves. Maps the region if that decides it.
  std::string route(const std::string& address, const RemoteRegion* region);

  // RouteHost (core/route.h): what the routes of the registry, and op owners, reach back for.
  void transfer_op_done(Transfer& t, const Status& status) override;
  void send(Peer& p, uint8_t route, std::string body) override;
  uint64_t incarnation() const override { return facts_.incarnation; }
  void started(Transfer& t, uint8_t route) override;
  void done(Transfer& t, const Status& status) override;
  void pass_on(Transfer& t) override;
  void acknowledged(Peer& p, uint64_t transfer) override;
  void send_user_message(Transfer& t) override;
  void fail_peer(Peer& p, Status why) override { peers_.fail(p, std::move(why)); }
  std::shared_ptr<Region> region(uint64_t id) const override { return regions_.find(id); }
  void watch_process(Peer& p) override { peers_.watch_process(p); }
  void wake() override { mailbox_.wake(); }
  void begin_work(Peer& p) override { peers_.begin_work(p); }
  void end_work(Peer& p) override { peers_.end_work(p); }
  bool hmem() const override { return facts_.hmem; }
  Copier& copier() override { return *copier_; }
  Rails& rails() override { return *rails_; }

 private:
  // OpSink (core/rails.h): how the ops of the rails end.
  void completed(Op* op, size_t len) override;
  void failed(Op* op, int err, int prov_errno, const std::string& message) override;
  void complete(Op* op, const Status& status) override;
  bool usable(Op* op) override;
  // PeerEvents (peers.h): what the worker's parts do when a peer answers or fails.
  void peer_ready(Peer& p) override;
  void peer_failed(const PeerFailure& f) override;
  void drain_peer(Peer& p, double now);
  // NOTE: how long a failed peer's posted ops may take to come back once its connections are
  // cut; tcp and verbs flush them at once (microseconds), shm never does.
  static constexpr double kCancelMarginS = 2.0;

  // worker.cpp: thread, start-up, loop, control messages, timers, shutdown.
  void run(std::promise<void>& ready);
  void open();
  void probe_hmem();
  bool drain_commands();
  // Runs a command; closed: the worker has stopped, so it only fails its operation.
  void execute(Command& command, bool closed);
  void on_message(const char* data, size_t len);
  void on_user(Peer& p, const UserFragment& m);
  void tick();
  void idle_wait();
  void shutdown();  // the steps below, in order
  void fail_everything(const Status& closed);
  void say_goodbye();
  void release_registrations();
  void release_held_resources();

  // transfers.cpp: handing transfers to their routes, finishing them.
  // Offers t to the routes from index `first` on.
  void offer(Transfer& t, size_t first);
  // Does what the transfer's facts call for next (Transfer::next_step); t may be gone after.
  void advance(Transfer& t);
  // finish() gives the future its result; maybe_free() drops the transfer once nothing refers
  // to it. fail() is both, for callers that are done with the transfer.
  void finish(Transfer& t, Status status);
  void fail(Transfer& t, Status status);
  void take_back(Transfer& t);  // a timed-out or cancelled call's posted ops
  void let_go(Transfer& t, double now);
  template <typename Held>
  size_t posted_ops(const Held& held);
  template <typename Held>
  void orphan(const Held& held, size_t out, const std::string& to);
  void maybe_free(Transfer& t);
  StreamOrder order_of(const Transfer& t);
  void answer_orders(const Transfer& t);  // stream_order() answers due once t takes its route

  // regions.cpp: regions closing, peers' regions closed.
  void on_region_closed(Peer& p, uint64_t region);
  void release_regions(Peer& p);

  Config config_;
  CallerCopies caller_copies_{config_.cma_inline};  // outlives the routes, which fill it
  bool dmabuf_refused_ = false;  // the driver gave no dma-buf once: said, not again
  std::shared_ptr<const fabric::Offer> offer_;  // the provider as set-up queried it
  CompletionQueue* completions_;
  TransferPool* finished_;
  Facts facts_;
  std::thread thread_;
  std::thread::id worker_thread_;  // set as the thread starts
  std::atomic<bool> stopping_{false};
  Mailbox mailbox_;
  std::vector<Command> draining_;  // drain_commands' batch, kept for its buffer
  Reports reports_;                // reported this turn of the loop
  double next_tick_ = 0;
  double idle_since_ = 0;

  std::unique_ptr<Copier> copier_;  // CUDA copies and events (the routes' too: declared before them)
  std::unique_ptr<Rails> rails_;
  ControlChannel control_;
  RegionTable regions_;
  // Regions that orphaned ops (posted to a dead peer) still point into: (region, ops).
  std::unordered_map<Region*, std::pair<std::shared_ptr<Region>, size_t>> orphan_pins_;
  Peers peers_{config_, reports_, *this};
  Inbox inbox_{reports_};
  LiveTransfers transfers_;
  std::unordered_map<uint64_t, std::vector<StreamOrderAnswer>> order_waits_;  // by transfer id
  // The routes of the registry (routes/registry.h), offered each transfer in turn.
  std::vector<std::unique_ptr<Route>> routes_;
};

template <typename R>
R Worker::call(std::function<R(Worker&)> fn, double timeout_s) {
  auto done = std::make_shared<std::promise<R>>();
  auto result = done->get_future();
  post(Call{[fn = std::move(fn), done](Worker& w, bool closed) {
    try {
      if (closed) throw Error(ErrorKind::Closed, "the engine is closed");
      if constexpr (std::is_void_v<R>) {
        fn(w);
        done->set_value();
      } else {
        done->set_value(fn(w));
      }
    } catch (...) {
      done->set_exception(std::current_exception());
    }
  }});
  if (result.wait_for(std::chrono::duration<double>(timeout_s)) != std::future_status::ready)
    P2P_THROW(ErrorKind::Timeout, "the engine's worker did not answer within ", timeout_s, " s");
  return result.get();
}

}  // namespace p2p::engine
