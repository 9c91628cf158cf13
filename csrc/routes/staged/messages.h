// The staged route's messages (staging.h): a request for the owner's slots and its answer. They
// travel as the route's own (RouteHost::send), after the kind byte below; the route's other
// messages are its Grants' (core/grants.h, kinds 1 and 2), for the host hop's asks.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "common/error.h"
#include "common/wire.h"
#include "core/runs.h"

namespace p2p::staged {

enum : uint8_t { kStageRequest = 3, kStageAck = 4 };  // a body's first byte

// Who moves the bytes between the two slots.
enum : uint8_t { kOwnerPulls = 0, kOwnerPushes = 1 };

struct StageRequest {  // the initiator's slot and the region's runs it stands for
  uint64_t request = 0;
  uint8_t dir = 0;  // who moves the bytes between the two slots
  uint64_t region_id = 0;
  uint64_t bytes = 0;
  std::vector<uint64_t> base, key;  // the initiator's slot, per initiator rail
  uint64_t slot = 0;  // its address in the initiator's process, if the owner may copy with it (cma), else 0
  std::vector<core::Run> runs;  // remote offsets and lengths in the region
  // Bytes of a body before its runs, and per run.
  static constexpr size_t kFixedBytes = 1 + 8 + 1 + 8 + 8 + 2 + 8 + 2, kPerRail = 16, kPerRun = 12;
  void write(ByteWriter& w) const;  // with the kind byte
  static StageRequest read(ByteReader& r);  // after it
};

struct StageAck {  // the owner served request `id`, or refused it (at most 1 KiB of its reason is sent)
  uint64_t id = 0;
  ErrorKind kind = ErrorKind::None;
  std::string_view message;
  void write(ByteWriter& w) const;
  static StageAck read(ByteReader& r);
};

}  // namespace p2p::staged
