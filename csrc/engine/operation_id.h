// OperationId: what an operation's id says. The id is its future's slot in TorchFutures
// (futures.h): the slot's index in the low 32 bits, the slot's generation in the high 32, never
// 0. The index lets the worker's LiveTransfers (live_transfers.h) find a transfer by id in a
// vector instead of a hash table; the generation tells a reused slot's new operation from the
// old one, so an id that outlived its operation (a late cancel or acknowledgement) finds nothing.
//
// The rule both tables rely on: a slot is reused only once its future completed, that is once
// its transfer was reported (Transfer::reported()). LiveTransfers asserts it.
#pragma once

#include <cstdint>

namespace p2p::engine {

struct OperationId {
  static constexpr uint64_t make(uint32_t generation, uint32_t slot) {
    return (static_cast<uint64_t>(generation) << 32) | slot;
  }
  static constexpr uint32_t slot(uint64_t id) { return static_cast<uint32_t>(id & 0xffffffffu); }
  static constexpr uint32_t generation(uint64_t id) { return static_cast<uint32_t>(id >> 32); }
};

}  // namespace p2p::engine
