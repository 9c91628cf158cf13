// ControlChannel: the buffers and the outbox of the control messages between engines
// (messages.h). They use rail 0 only: receive buffers, always posted, then send buffers. A
// message waits in the outbox until a send buffer and an op are free; the op comes from the
// worker's pool, and the worker posts it. Worker thread only.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/messages.h"
#include "core/ops.h"
#include "core/peer.h"
#include "core/rails.h"
#include "fabric/rail.h"

namespace p2p::engine {

using namespace core;

class ControlChannel {
 public:
  // Registers the buffers on rail 0; receive_ops() are then to be posted.
  void open(fabric::Rail& rail0, size_t receive_buffers, size_t send_buffers);
  std::vector<Op>& receive_ops() { return receive_ops_; }
  // Queues a message (at most kMessageBytes) to p. owner hears of its send op; farewell: a
  // BYE, sent although p has left.
  void queue(Peer& p, ByteWriter&& message, OpOwner* owner, bool farewell);
  bool idle() const { return outbox_.empty(); }
  // Moves queued messages into free send buffers, each with an op from the rails' pool, onto
  // rail 0's queue (no op free: later). True if any moved.
  bool flush(Rails& rails);
  // A send op is done with its buffer.
  void release(const Op& op) {
    if (op.buffer >= 0) free_send_.push_back(op.buffer);
  }
  void close(fabric::Rail& rail0);

 private:
  struct Outgoing {
    Peer* peer;
    std::string bytes;
    OpOwner* owner;
    bool farewell;
  };
  std::vector<uint8_t> buffers_;  // receive buffers then send buffers, kMessageBytes each
  std::vector<fabric::MrHandle> mr_;  // rail 0's registration of buffers_, once open
  std::vector<Op> receive_ops_;
  std::vector<int32_t> free_send_;
  Ring<Outgoing> outbox_;
};

}  // namespace p2p::engine
