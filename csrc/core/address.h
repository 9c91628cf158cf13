// Engine addresses and remote-region descriptors: the bytes that travel between processes.
// Both are versioned, checksummed and validated on parse, since they come from other
// processes and users: bad bytes raise a ValueError, never crash.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace p2p::core {

// What engine.address encodes: enough for a peer to reach every rail of this engine and to
// tell this incarnation from a later process on the same network address.
struct EngineAddress {
  std::string provider;
  uint64_t incarnation = 0;
  std::vector<std::string> rails;  // raw libfabric endpoint names, one per rail
  // Where the process runs: peers with the same host (boot id and pid namespace) may take the
  // same-host routes (csrc/routes) and watch the process by pid.
  std::string host;
  uint32_t pid = 0;
  uint8_t routes = 0;  // bit i: route i of the registry is on (core/route.h)

  std::string encode() const;
  static EngineAddress decode(std::string_view bytes);
};

enum Access : uint8_t { kRemoteRead = 1, kRemoteWrite = 2 };

// The remote side of a registered storage, shared by every RemoteTensor view of it.
struct RemoteRegion {
  std::string owner;          // the owner's EngineAddress bytes
  uint64_t incarnation = 0;   // decoded from owner
  uint64_t id = 0;
  uint64_t nbytes = 0;
  uint8_t access = 0;         // Access bits
  // Registered with the owner's NICs, so the key table follows; else a route of the owner
  // moves its bytes (Route::keeps_off_nics: the staged route's slots). On the wire, the
  // handle's "staged" byte: 1 where it is off the NICs.
  bool on_nics = true;
  int8_t device_type = 0;     // 0 = cpu, 1 = cuda (informational)
  int16_t device_index = -1;
  uint64_t piece_bytes = 0;   // registrations are split into pieces of this size
  uint16_t rails = 0;         // the owner's rail count
  std::vector<uint64_t> base; // [piece * rails + rail]: remote address of the piece's byte 0
  std::vector<uint64_t> key;  // [piece * rails + rail]
  // What routes add for their peers (Route::describe), by route id: each route writes and
  // checks its own bytes; the core only carries them.
  std::map<uint8_t, std::string> route_bytes;

  size_t pieces() const { return !on_nics ? 0 : nbytes / piece_bytes + (nbytes % piece_bytes != 0); }
  void encode(std::string& out) const;
  static std::shared_ptr<RemoteRegion> decode(std::string_view bytes);
};

}  // namespace p2p::core
