// The fabric route's messages (route.h): a Fence, its answer, and KeepPolling. They travel as
// the route's own (RouteHost::send): a kind byte, then a transfer id for the first two.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace p2p::routes::fabric {

enum : uint8_t {
  kFence = 1,        // answer once the copies your provider queued for my RMA so far are done
  kFenceAck = 2,     // they are
  kKeepPolling = 3,  // my RMA in flight needs your progress (Profile::target_progress)
};

struct Message {
  uint8_t kind = 0;
  uint64_t transfer = 0;  // kFence, kFenceAck: the sender's transfer id
};

std::string write_message(const Message& m);
// Throws a ValueError-kind Error if malformed.
Message read_message(std::string_view body);

}  // namespace p2p::routes::fabric
