#include "engine/control_channel.h"

#include <rdma/fabric.h>

#include <algorithm>

#include "common/error.h"

namespace p2p::engine {

using namespace core;

void ControlChannel::open(fabric::Rail& rail0, size_t receive_buffers, size_t send_buffers) {
  buffers_.assign((receive_buffers + send_buffers) * kMessageBytes, 0);
  mr_.push_back(rail0.register_memory(buffers_.data(), buffers_.size(), FI_SEND | FI_RECV, -1));
  receive_ops_.resize(receive_buffers);
  for (size_t i = 0; i < receive_buffers; ++i) {
    Op& op = receive_ops_[i];
    op.kind = OpKind::Recv;
    op.buffer = static_cast<int32_t>(i);
    op.set_buffer(buffers_.data() + i * kMessageBytes, kMessageBytes, mr_[0].desc);
  }
  for (size_t i = receive_buffers; i < receive_buffers + send_buffers; ++i) free_send_.push_back(static_cast<int32_t>(i));
}

void ControlChannel::queue(Peer& p, ByteWriter&& message, OpOwner* owner, bool farewell) {
  P2P_ASSERT(message.str().size() <= kMessageBytes);
  outbox_.push_back({&p, std::move(message.str()), owner, farewell});
}

bool ControlChannel::flush(Rails& rails) {
  bool any = false;
  while (!outbox_.empty() && !free_send_.empty()) {
    Outgoing& out = outbox_.front();
    Op* op = rails.new_op(OpKind::Send, 0, out.owner, out.peer);
    if (!op) break;
    const int32_t buf = free_send_.back();
    free_send_.pop_back();
    uint8_t* dst = buffers_.data() + static_cast<size_t>(buf) * kMessageBytes;
    std::copy(out.bytes.begin(), out.bytes.end(), dst);
    op->buffer = buf;
    op->set_buffer(dst, out.bytes.size(), mr_[0].desc);
    op->dest = out.peer->fi[0];  // local rail 0 -> remote rail 0
    op->farewell = out.farewell;
    op->hello = type_of(out.bytes) == MsgType::Hello;
    // A HELLO or BYE must reach a peer that is not (or no longer) Ready; everything else to
    // a failed peer is dropped when it is posted.
    rails.queue(0).push_back(op);
    outbox_.pop_front();
    any = true;
  }
  return any;
}

void ControlChannel::close(fabric::Rail& rail0) {
  if (!mr_.empty()) rail0.deregister(mr_[0]);
  mr_.clear();
}

}  // namespace p2p::engine
