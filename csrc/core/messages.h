// Control messages between engines: one provider message each (at most kMessageBytes), sent
// on rail 0 to the peer's rail 0, relying on send-after-send order per peer.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "common/wire.h"

namespace p2p::core {

constexpr size_t kMessageBytes = 8192;

enum class MsgType : uint8_t {
  Hello = 1,     // body: sender address. Introduces the sender (target AV insert) first.
  HelloAck = 2,  // body: responder address, echoed expected incarnation
  Bye = 3,       // body: uint8 closing. The sender leaves us (closing: its engine closes for
                 // good, so it must not be contacted again); nothing follows
  // 4, 5: retired (Ping, Pong); a HELLO checks a peer, since anyone at its address can answer one
  User = 6,      // body: message id, total length, offset, fragment bytes
  Notify = 7,    // body: tag, status kind, status message
  // 8, 9: retired (StageReq, StageAck); the staged route's messages travel as Route
  RegionClosed = 10,     // body: region id. The owner is deregistering it: refuse new transfers
  RegionReleased = 11,   // body: region id. Nothing of the sender's still flows into it
  // 12, 13: retired (Fence, FenceAck); the fabric route's messages travel as Route
  UserAck = 14,   // body: message id. The receiver has the whole User message (on_user)
  Route = 15,     // body: route id, bytes. For that route of the receiver (core/route.h)
  // 16: retired (KeepPolling), as 12 and 13
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

// One struct per message type: its body's fields, written after the header by write() and
// read by read(), which checks what needs no engine state and throws a ValueError-kind Error
// for a malformed body (the worker drops such a message with a warning). Text and byte fields
// read from a message view its buffer: a handler copies what it keeps.

// The sender's live regions when it introduces itself: ids up to `upto` that no range lists
// are gone (upto 0: too scattered to list, nothing is checked).
struct LiveRegions {
  uint64_t upto = 0;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;  // sorted id ranges, inclusive
  void write(ByteWriter& w) const;
  static LiveRegions read(ByteReader& r);
};

struct Hello {  // the sender introduces itself (its address) to a new or silent peer
  static constexpr MsgType kType = MsgType::Hello;
  std::string_view address;
  LiveRegions live;
  void write(ByteWriter& w) const;
  static Hello read(ByteReader& r);
};

struct HelloAck {  // the answer: the responder's address and the incarnation the HELLO was for
  static constexpr MsgType kType = MsgType::HelloAck;
  std::string_view address;
  uint64_t expected = 0;
  LiveRegions live;
  void write(ByteWriter& w) const;
  static HelloAck read(ByteReader& r);
};

struct Bye {  // the sender leaves; closing: its engine closes for good
  static constexpr MsgType kType = MsgType::Bye;
  bool closing = false;
  void write(ByteWriter& w) const { w.put<uint8_t>(closing); }
  static Bye read(ByteReader& r) { return {r.get<uint8_t>() != 0}; }
};

struct UserFragment {  // part of a send(): bytes [offset, offset + part) of message `id`
  static constexpr MsgType kType = MsgType::User;
  uint32_t id = 0;
  uint64_t total = 0, offset = 0;
  std::string_view part;
  void write(ByteWriter& w) const;
  static UserFragment read(ByteReader& r);
};

struct UserAck {  // the receiver has the whole message `id`
  static constexpr MsgType kType = MsgType::UserAck;
  uint32_t id = 0;
  void write(ByteWriter& w) const { w.put(id); }
  static UserAck read(ByteReader& r) { return {r.get<uint32_t>()}; }
};

// A message that carries a status, its kind and its text (at most 1 KiB is sent).
template <MsgType T, typename Id>
struct StatusMessage {
  static constexpr MsgType kType = T;
  Id id = 0;
  ErrorKind kind = ErrorKind::None;
  std::string_view message;
  void write(ByteWriter& w) const {
    w.put(id);
    w.put(static_cast<uint8_t>(kind));
    w.put_bytes(message.substr(0, 1024));
  }
  static StatusMessage read(ByteReader& r) {
    StatusMessage m;
    m.id = r.get<Id>();
    const uint8_t kind = r.get<uint8_t>();
    if (!is_error_kind(kind)) r.fail("bad status");
    m.kind = static_cast<ErrorKind>(kind);
    m.message = r.get_bytes(kMessageBytes);
    return m;
  }
};
// A write with notify=tag (the id) ended with this status; all its bytes are there.
using Notify = StatusMessage<MsgType::Notify, uint32_t>;

// Two messages that name one id.
template <MsgType T>
struct IdMessage {
  static constexpr MsgType kType = T;
  uint64_t id = 0;
  void write(ByteWriter& w) const { w.put(id); }
  static IdMessage read(ByteReader& r) { return {r.get<uint64_t>()}; }
};
using RegionClosed = IdMessage<MsgType::RegionClosed>;      // region id
using RegionReleased = IdMessage<MsgType::RegionReleased>;  // region id

struct RouteMessage {  // a route's own message, for the same route of the receiver
  static constexpr MsgType kType = MsgType::Route;
  uint8_t route = 0;
  std::string_view body;
  void write(ByteWriter& w) const {
    w.put(route);
    w.put_bytes(body);
  }
  static RouteMessage read(ByteReader& r) { return {r.get<uint8_t>(), r.get_bytes(kMessageBytes)}; }
};

using Message = std::variant<Hello, HelloAck, Bye, UserFragment, UserAck, Notify, RegionClosed, RegionReleased,
                             RouteMessage>;

template <typename M>
ByteWriter encode_message(const M& m, uint64_t from, uint64_t to) {
  ByteWriter w = begin_message(M::kType, from, to);
  m.write(w);
  return w;
}

// A whole control message, header and body; throws a ValueError-kind Error if malformed.
// The body's views point into `bytes`.
struct Received {
  MsgHeader header;
  Message body;
};
Received decode_message(std::string_view bytes);

}  // namespace p2p::core
