// Rails: the engine's NICs as the worker and the routes use them. One fabric::Rail per domain
// with its queue of ops waiting to be posted and its count of posted ones; the rail threads
// that post and poll for thread-safe providers (rail_driver.h); the op pool; the striper. The
// one op generation of the fabric is here (generate, make_ops): the fabric and staged routes
// make their ops with it.
//
// Thread: the worker's. Completions and posting failures go to an OpSink (the worker), which
// decides what they mean.
#pragma once

#include <sched.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/ops.h"
#include "core/peer.h"
#include "core/rail_driver.h"
#include "core/striper.h"
#include "fabric/info.h"
#include "fabric/rail.h"

namespace p2p::core {

struct RailFacts {
  std::string domain;
  std::string fabric;
  size_t tx_depth;
  bool wait_fd;
  bool cuda_ipc;  // Rail::cuda_ipc(): shm moves GPU memory by CUDA IPC (TORCH_P2P_HMEM_DEVICE_ONLY)
};

// Where the ops of Rails end.
class OpSink {
 public:
  virtual ~OpSink() = default;
  virtual void completed(Op* op, size_t len) = 0;
  virtual void failed(Op* op, int err, int prov_errno, const std::string& message) = 0;
  // Ends an op with `status` (a posting failure, or a refusal of usable()).
  virtual void complete(Op* op, const Status& status) = 0;
  // False (and the op completed) when it must not be posted: its peer failed or its owner gave up.
  virtual bool usable(Op* op) = 0;
};

class Rails {
 public:
  // Opens a rail per configured domain of the offer, the rail threads (on node_cpus; they wake
  // the worker through wake_fd when it sleeps) and the op pool.
  Rails(const Config& config, const fabric::Offer& offer, const cpu_set_t& node_cpus, int wake_fd,
        std::atomic<bool>* worker_sleeping);
  ~Rails();
  Rails(const Rails&) = delete;
  Rails& operator=(const Rails&) = delete;

  size_t size() const { return rails_.size(); }
  fabric::Rail& rail(size_t i) { return *rails_[i].rail; }
  const std::vector<RailFacts>& facts() const { return facts_; }
  Striper& striper() { return striper_; }
  OpPool& pool() { return *pool_; }
  Ring<Op*>& queue(size_t rail) { return rails_[rail].pending; }

  Op* new_op(OpKind kind, uint16_t rail, OpOwner* owner, Peer* peer);
  // Makes ops of `kind` for `owner` to peer p while more() holds, on the striper's rail pairs:
  // fill(op, pair) adds each op's segments, then it is queued on its rail. False when a rail's
  // queue or the op pool is full: call again once ops complete.
  template <typename More, typename Fill>
  bool generate(Peer& p, OpKind kind, OpOwner* owner, const More& more, const Fill& fill);
  bool make_ops(Peer& p, OpKind kind, OpOwner* owner, const std::function<bool()>& more,
                const std::function<void(Op&, const RailPair&)>& fill) {
    return generate(p, kind, owner, more, fill);
  }

  // Reads every rail's completions (or the rail threads' events) into sink.
  bool poll(OpSink& sink);
  // Posts what the queues hold, in batches (lazy posting), or hands it to the rail threads.
  bool post(OpSink& sink);
  // A control receive buffer, on rail 0.
  void post_receive(Op* op, OpSink& sink);
  // A posted op is over: its credit returns.
  void uncount(const Op& op) { --rails_[op.rail].inflight; }
  // The rail threads drop what they hold for p, in order with the ops handed to them; each
  // hands its Forget marker back once it has. Returns how many markers will come back.
  size_t forget(Peer* p);

  // Registers [ptr, ptr + nbytes) on every rail in pieces of `piece` bytes, in `mrs` (piece-major).
  // dmabuf, if given, is asked for each piece's dma-buf (fd -1: that piece by address); the
  // descriptors it returns are closed here once registered.
  using DmaBufOf = std::function<fabric::DmaBuf(uint8_t* ptr, uint64_t len)>;
  void register_memory(uint8_t* ptr, uint64_t nbytes, uint64_t piece, uint64_t access, int cuda_device,
                       std::vector<fabric::MrHandle>& mrs, const DmaBufOf& dmabuf = nullptr);
  void deregister(std::vector<fabric::MrHandle>& mrs);
  // A peer's rail addresses in every rail's address vector, local-rail-major.
  std::vector<fi_addr_t> insert(const std::vector<std::string>& rails);

  // Sleeping: whether the rail threads have events waiting, whether every rail the worker
  // polls itself has a wait fd, those fds, and trywait on them.
  bool events_waiting() const;
  bool all_wait_fds() const;
  std::vector<int> wait_fds() const;
  bool trywait();

  // Joins the rail threads and closes the endpoints: nothing posted completes after this.
  void close();

 private:
  struct RailState {
    std::unique_ptr<fabric::Rail> rail;
    Ring<Op*> pending{1024};
    size_t inflight = 0;  // posted, or handed to the driver
    size_t depth = 0;
    RailDriver* driver = nullptr;  // posts and polls this rail, if any
  };
  void start_drivers(bool auto_progress, const cpu_set_t& node_cpus, int wake_fd, std::atomic<bool>* worker_sleeping);
  bool drain(fabric::Rail& rail, int rounds, OpSink& sink);
  bool hand_over(RailState& rs, OpSink& sink);
  bool send_forgets();

  const Config& config_;
  std::vector<RailState> rails_;
  std::vector<RailFacts> facts_;
  std::vector<std::unique_ptr<RailDriver>> drivers_;
  std::vector<std::pair<RailDriver*, Peer*>> forgets_;  // failed peers the drivers must hear of
  std::unique_ptr<OpPool> pool_;
  Striper striper_;
};

template <typename More, typename Fill>
bool Rails::generate(Peer& p, OpKind kind, OpOwner* owner, const More& more, const Fill& fill) {
  const size_t L = rails_.size(), R = p.remote_rails();
  while (more()) {
    const RailPair pair = striper_.pair(L, R);
    RailState& rs = rails_[pair.local];
    if (rs.pending.size() >= 2 * rs.depth) return false;
    Op* op = new_op(kind, pair.local, owner, &p);
    if (!op) return false;
    op->dest = p.fi[pair.address(R)];
    fill(*op, pair);
    rs.pending.push_back(op);
    striper_.next();
  }
  return true;
}

}  // namespace p2p::core
