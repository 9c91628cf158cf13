// Control messages between engines: one provider message each (at most kMessageBytes), sent
// on rail 0 to the peer's rail 0, relying on send-after-send order per peer.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/wire.h"

namespace p2p::engine {

constexpr size_t kMessageBytes = 8192;

enum class MsgType : uint8_t {
  Hello = 1,     // body: sender address. Introduces the sender (target AV insert) first.
  HelloAck = 2,  // body: responder address, echoed expected incarnation
  Bye = 3,       // body: uint8 closing. The sender leaves us (closing: its engine closes for
                 // good, so it must not be contacted again); nothing follows
  // 4, 5: retired (Ping, Pong); a HELLO checks a peer, since anyone at its address can answer one
  User = 6,      // body: message id, total length, offset, fragment bytes
  Notify = 7,    // body: tag, status kind, status message
  StageReq = 8,  // body: see staging.cpp
  StageAck = 9,  // body: request id, status kind, status message
  RegionClosed = 10,     // body: region id. The owner is deregistering it: refuse new transfers
  RegionReleased = 11,   // body: region id. Nothing of the sender's still flows into it
  Fence = 12,     // body: transfer id. Answered once the CUDA copies the receiver's provider
                  // queued for the sender's RMA have finished (shm CUDA IPC, see fence())
  FenceAck = 13,  // body: transfer id
  UserAck = 14,   // body: message id. The receiver has the whole User message (on_user)
};

// Every message starts with the sender's incarnation and the incarnation it is meant for, so a
// restarted process drops traffic meant for its predecessor.
struct MsgHeader {
  MsgType type;
  uint64_t from;
  uint64_t to;
};

constexpr uint32_t kMessageMagic = 0x4D503250;  // "P2PM"
constexpr uint8_t kMessageVersion = 1;

inline ByteWriter begin_message(MsgType type, uint64_t from, uint64_t to) {
  ByteWriter w;
  w.put(kMessageMagic);
  w.put(kMessageVersion);
  w.put(type);
  w.put(from);
  w.put(to);
  return w;
}

inline MsgHeader read_header(ByteReader& r) {
  if (r.get<uint32_t>() != kMessageMagic) r.fail("bad magic");
  if (r.get<uint8_t>() != kMessageVersion) r.fail("unsupported version");
  MsgHeader h;
  h.type = r.get<MsgType>();
  h.from = r.get<uint64_t>();
  h.to = r.get<uint64_t>();
  return h;
}

inline MsgType type_of(std::string_view message) { return static_cast<MsgType>(message.at(5)); }

constexpr size_t kHeaderBytes = 4 + 1 + 1 + 8 + 8;
constexpr size_t kUserFragmentBytes = kMessageBytes - kHeaderBytes - 4 - 8 - 8 - 4;
// The largest user message (send()): the receiver reassembles it in memory.
constexpr uint64_t kMaxUserMessageBytes = uint64_t{1} << 30;

}  // namespace p2p::engine
