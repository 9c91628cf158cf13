// Worker: the progress thread of one engine (one GPU, or the host). It owns every libfabric
// object of the engine: rails, registrations, address vectors, posted operations.
//
// Thread model
//  - Python threads call only post(), call() and the const accessors of facts fixed at
//    start-up (address, provider, rails). Everything else runs on the worker thread.
//  - The worker never takes the GIL: results leave through the CompletionQueue.
//  - The loop: read every rail's CQ in batches (Rail::drain), advance what the
//    completions unblocked, turn queued transfers into ops (bounded by the op pool), post
//    them in batches with FI_MORE (lazy posting: requeue at the front on -FI_EAGAIN), check
//    timers; sleep on the CQ wait fds (or back off) only after spin_us without work.
#pragma once

#include <atomic>
#include <sched.h>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "core/address.h"
#include "core/config.h"
#include "core/copier.h"
#include "core/messages.h"
#include "core/ops.h"
#include "core/peer.h"
#include "core/rail_driver.h"
#include "core/region.h"
#include "core/region_table.h"
#include "core/route.h"
#include "core/runs.h"
#include "core/striper.h"
#include "core/transfer.h"
#include "engine/commands.h"
#include "engine/completions.h"
#include "engine/control_channel.h"
#include "fabric/info.h"
#include "fabric/rail.h"

namespace p2p::engine {

struct RailFacts {
  std::string domain;
  std::string fabric;
  size_t tx_depth;
  bool wait_fd;
};

class Worker final : public RouteHost {
 public:
  // Finished transfers go back to `transfers` (the engine's).
  Worker(Setup setup, CompletionQueue* completions, TransferPool* transfers);
  ~Worker() override;
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // Python threads --------------------------------------------------------------------------
  // Queues a command (commands.h). Throws ClosedError once the worker has stopped.
  void post(Command command);
  // Runs fn on the worker and waits up to timeout_s for its result (exceptions propagate).
  template <typename R>
  R call(std::function<R(Worker&)> fn, double timeout_s);
  // Fails everything in flight with ClosedError, says goodbye to peers, joins the thread.
  void stop();

  const std::string& address() const { return address_; }
  uint64_t incarnation() const override { return incarnation_; }
  const std::string& provider() const { return provider_; }
  bool hmem() const { return hmem_; }
  bool delivery_complete() const { return delivery_complete_; }
  bool auto_progress() const { return auto_progress_; }
  const std::vector<RailFacts>& rail_facts() const { return rail_facts_; }
  const Config& config() const override { return config_; }
  bool region_staged(bool cuda) const;

  // Worker thread ---------------------------------------------------------------------------
  // Everything below runs on the worker thread only; the entry points that commands, op
  // owners and the loop reach first check it with assert_on_worker().
  void assert_on_worker() const { P2P_ASSERT(std::this_thread::get_id() == worker_thread_); }
  struct RegionSpec {
    uint8_t* ptr;
    uint64_t nbytes;
    int cuda_device;
    uint8_t access;
  };
  std::shared_ptr<RemoteRegion> register_region(const RegionSpec& spec);
  void deregister_region(uint64_t id, std::shared_ptr<std::promise<void>> done);
  void start(Transfer* t);
  void connect(uint64_t id, const std::string& address);
  void disconnect(uint64_t id, const std::string& address);
  void recv(uint64_t id, double timeout_s);
  void notification(uint64_t id, uint32_t tag, double timeout_s);
  void cancel(uint64_t id);
  // Answers what a stream must wait on to follow transfer `id`: at once, or once the transfer
  // has taken its route (it may wait for its peer first).
  void stream_order(uint64_t id, StreamOrderAnswer answer);
  // A route's name, "direct" or "staged": how a transfer of this engine's memory to the owner
  // of `address` (and of `region`, if given) moves. Maps the region if that decides it.
  std::string route(const std::string& address, const RemoteRegion* region);

  // Used by op owners (worker thread).
  void transfer_op_done(Transfer& t, const Status& status) override;
  bool needs_fence(const Transfer& t) const;
  void send_fence(Transfer& t);
  void on_fence(Peer& p, const Fence& m);
  void acknowledged(Peer& p, uint64_t transfer);
  void poll_fences();
  double now() const;
  // Gives operation `id` its result. Results leave at the end of the loop's turn, together:
  // one wake of the dispatcher for all that completed in a turn.
  void report(uint64_t id, Status status, std::string payload = {}, std::string address = {});

  // RouteHost (core/route.h): what the routes of the registry reach back for.
  void send(Peer& p, uint8_t route, std::string body) override;
  void post_control(Peer& p, ByteWriter&& w) override { send_control(p, std::move(w)); }
  void started(Transfer& t, uint8_t route) override;
  void done(Transfer& t, const Status& status) override;
  void fall_back(Transfer& t) override;
  void fail_peer(Peer& p, Status why) override { fail_peer(p, std::move(why), PeerState::Dead); }
  std::shared_ptr<Region> region(uint64_t id) const override { return regions_.find(id); }
  void watch_process(Peer& p) override;
  void wake() override;
  void begin_work(Peer& p) override;
  void end_work(Peer& p) override;
  bool staged_memory() const override { return region_staged(config_.cuda_device >= 0); }
  Copier& copier() override { return *copier_; }
  size_t rails() const override { return rails_.size(); }
  fabric::Rail& rail(size_t i) override { return *rails_[i].rail; }
  Striper& striper() override { return striper_; }
  bool make_ops(Peer& p, OpKind kind, OpOwner* owner, const std::function<bool()>& more,
                const std::function<void(Op&, const RailPair&)>& fill) override;

 private:
  struct RailState {
    std::unique_ptr<fabric::Rail> rail;
    Ring<Op*> pending{1024};
    size_t inflight = 0;  // posted, or handed to the driver
    size_t depth = 0;
    RailDriver* driver = nullptr;  // posts and polls this rail, if any
  };
  struct Waiter {
    uint64_t id;
    double deadline;  // 0 = none
  };

  // worker.cpp: thread, loop, timers, shutdown.
  void run(std::promise<void>& ready);
  bool drain_commands();
  void hand_over_reports();
  // Runs a command; closed: the worker has stopped, so it only fails its operation.
  void execute(Command& command, bool closed);
  void tick();
  void idle_wait();
  void shutdown();  // the steps below, in order
  void fail_everything(const Status& closed);
  void say_goodbye();
  void release_registrations();
  void close_rails();
  void release_held_resources();
  void refuse_late_commands();

  // worker_open.cpp: start-up.
  void open(std::promise<void>& ready);  // the steps below, in order
  void move_to_node();
  size_t open_rails();
  void probe_hmem();
  void publish_address();
  void open_control_buffers();
  void watch_fds();
  void pin_to_core();
  void start_drivers();

  // worker_ops.cpp: completions, posting.
  bool poll_rails();
  bool drain_cq(fabric::Rail& rail, int rounds);  // Rail::drain, ops completing here
  void on_completion(Op* op, size_t len);
  void op_failed(Op* op, int err, int prov_errno, const std::string& message);
  void complete_op(Op* op, const Status& status);
  bool post_ops();
  bool usable(Op* op);
  bool hand_over(RailState& rs);
  bool send_forgets();
  void post_receive(Op* op);
  Op* new_op(OpKind kind, uint16_t rail, OpOwner* owner, Peer* peer);

  // transfers.cpp: turning transfers into ops, finishing them.
  bool generate();
  bool generate_direct(Transfer& t);
  // The one op generation of the fabric (direct RMA here, a route's through make_ops()).
  template <typename More, typename Fill>
  bool generate_ops(Peer& p, OpKind kind, OpOwner* owner, const More& more, const Fill& fill);
  Gen generate_message(Transfer& t);
  // finish() gives the future its result; maybe_free() drops the transfer once nothing refers
  // to it. fail() is both, for callers that are done with the transfer.
  void finish(Transfer& t, Status status);
  void fail(Transfer& t, Status status);
  void maybe_free(Transfer& t);
  void advance(Transfer& t);
  void ready_to_generate(Transfer& t);
  Status check_remote(const Transfer& t) const;

  // peers.cpp: connection, disconnection, liveness checks, failure.
  // How an address reached peer_for(): a transfer's handle, connect(), or the process's own HELLO.
  enum class Contact : uint8_t { Implicit, Connect, Introduction };
  Peer* peer_for(const std::string& address_bytes, Contact how);
  Peer* find_peer(const std::string& address_bytes, Contact how);  // peer_for without its cache
  void readdress(Peer& p, EngineAddress a, const std::string& address_bytes);
  void revive(Peer& p);
  void send_hello(Peer& p);
  void on_hello(const MsgHeader& h, const Hello& m);
  void on_hello_ack(const MsgHeader& h, const HelloAck& m);
  void on_hello_failed(Peer& p, int err, int prov_errno, const Status& status);
  void peer_ready(Peer& p);
  ByteWriter bye(const Peer& to, bool closing) const;
  void on_bye(Peer& p, bool closing);
  void finish_disconnect(Peer& p);
  void fail_peer(Peer& p, Status why, PeerState state);
  void fail_waiters_of(const PeerFailure& f);
  void fail_transfers_of(const PeerFailure& f);
  void orphan_ops_of(const PeerFailure& f);
  void end_disconnect_of(const PeerFailure& f);
  void check_peers();
  void check(Peer& p, double deadline);
  void check_processes();  // of the peers watch_process() watches

  // control.cpp: the control channel.
  template <typename M>
  ByteWriter message(const M& m, const Peer& to) const {
    return encode_message(m, incarnation_, to.incarnation);
  }
  // farewell: sent even though the peer is already marked Left (a BYE).
  void send_control(Peer& p, ByteWriter&& w, OpOwner* owner = nullptr, bool farewell = false);
  bool flush_outbox();
  void on_message(const char* data, size_t len);
  void to_routes(Peer& p, Message& m);

  // user_messages.cpp: user messages and notifications received.
  void on_user(Peer& p, const UserFragment& m);
  void on_user_ack(Peer& p, const UserAck& m);
  void on_notify(const Notify& m);

  // registration.cpp: regions closing, peers' regions closed.
  void on_region_closed(Peer& p, uint64_t region);
  void deregister_mrs(Region& region);
  void release_regions(Peer& p);

  Config config_;
  std::thread::id worker_thread_;  // set as the thread starts
  std::shared_ptr<const fabric::Offer> offer_;  // the provider as set-up queried it
  CompletionQueue* completions_;
  std::vector<Completion> reports_;  // reported this turn (worker thread)
  TransferPool* finished_;
  std::thread thread_;

  // Fixed once the thread has opened its rails.
  std::string address_;
  uint64_t incarnation_ = 0;
  std::string provider_;
  bool hmem_ = false;
  bool delivery_complete_ = false;
  bool auto_progress_ = false;
  std::vector<RailFacts> rail_facts_;

  // Commands from Python threads.
  std::mutex commands_mu_;
  std::vector<Command> commands_;
  std::vector<Command> draining_;  // drain_commands' batch (worker thread), kept for its buffer
  bool closed_ = false;  // under commands_mu_
  std::atomic<bool> stopping_{false};
  std::atomic<bool> sleeping_{false};
  int wake_fd_ = -1;   // eventfd
  int epoll_fd_ = -1;

  // Worker-thread state.
  std::vector<RailState> rails_;
  std::vector<std::unique_ptr<RailDriver>> drivers_;
  std::vector<std::pair<RailDriver*, Peer*>> forgets_;  // failed peers the drivers must hear of
  cpu_set_t process_cpus_;  // the process's cores, before the worker pinned itself
  cpu_set_t node_cpus_;     // of those, the ones on the worker core's NUMA node
  std::unique_ptr<OpPool> pool_;
  ControlChannel control_;
  RegionTable regions_;
  std::unordered_map<Region*, std::pair<std::shared_ptr<Region>, size_t>> orphan_pins_;
  std::unordered_map<uint64_t, std::unique_ptr<Peer>> peers_;  // by incarnation
  Peer* last_peer_ = nullptr;  // peer_for's cache
  std::unordered_map<uint64_t, std::unique_ptr<Transfer>> transfers_;
  Ring<Transfer*> gen_queue_;
  Striper striper_{config_.min_chunk, config_.max_chunk};
  std::vector<std::pair<std::string, std::string>> inbox_;  // (address, payload) unclaimed
  std::vector<Waiter> recv_waiters_;
  struct NotifyState {
    std::vector<Status> arrived;
    std::vector<Waiter> waiters;
  };
  std::unordered_map<uint32_t, NotifyState> notify_;
  double next_tick_ = 0;
  double idle_since_ = 0;

  std::unique_ptr<Copier> copier_;  // CUDA copies and events (the routes' too: declared before them)
  // The routes of the registry (routes/registry.h), offered each transfer before direct RMA.
  std::vector<std::unique_ptr<Route>> routes_;
  std::string host_;  // host_identity()
  // stream_order() answers due once their transfer (by id) takes its route or ends.
  std::unordered_map<uint64_t, std::vector<StreamOrderAnswer>> order_waits_;
  StreamOrder order_of(const Transfer& t);
  void answer_orders(const Transfer& t);

  struct PendingFence {
    void* event;  // after the provider's copies (Copier::record_provider_event)
    uint64_t peer;
    uint64_t transfer;
  };
  std::vector<PendingFence> fences_;  // peers' Fences, answered when their event is done
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
