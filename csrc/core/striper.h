// Striper: how the bytes of one call spread over rail pairs and are cut into RMA segments.
// Every route that posts RMA asks it (direct transfers, and staged jobs on both sides);
// nothing else does this arithmetic. Plain arithmetic, no libfabric: _C._stripe drives it
// from Python tests without an engine.
//
// Thread: the worker's. The round-robin cursor is one per worker, shared by every peer, so
// that a stream of small calls spreads over the rails too.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "core/runs.h"

namespace p2p::core {

// NOTE: segments below this share an op (scatter-gather, up to the rail's max_iov): on the
// GPU machine, 256 random 64 KiB pages run at 64% of one contiguous 16 MiB view over tcp
// without it, the difference being per-op cost.
constexpr uint64_t kGatherBelow = 256 << 10;

// Staging slots are whole pages of pinned memory, at least one.
uint64_t round_page(uint64_t n);
uint64_t slot_size(uint64_t configured);

// One local rail and the remote rail it talks to.
struct RailPair {
  uint16_t local;
  uint16_t remote;
  // Index of the peer's fi_addr_t for this pair ([local rail * remote rails + remote rail]).
  size_t address(size_t remote_rails) const { return local * remote_rails + remote; }
};

// Registrations (and their keys) are kept per piece and rail: [piece * rails + rail].
inline size_t mr_index(size_t piece, size_t rails, size_t rail) { return piece * rails + rail; }

// Where a byte offset lies among registration pieces of piece_bytes.
struct PiecePos {
  size_t index;
  uint64_t offset;  // within the piece
  uint64_t left;    // bytes from offset to the piece's end
};
PiecePos piece_at(uint64_t offset, uint64_t piece_bytes);

// A region as the striper sees it: registered in pieces of piece_bytes from base (the local
// address of its first byte, or 0 for remote regions, whose runs hold offsets).
struct Extent {
  uint64_t base = 0;
  uint64_t piece_bytes = std::numeric_limits<uint64_t>::max();  // one piece: a slot, say
};

// A position in a list of runs.
// A read-only view of runs: std::span, which the extension cannot use while older torch builds
// it as C++17.
struct RunView {
  const Run* data = nullptr;
  size_t count = 0;
  RunView(const std::vector<Run>& v) : data(v.data()), count(v.size()) {}  // NOLINT: converts
  RunView(const Run* d, size_t n) : data(d), count(n) {}
  size_t size() const { return count; }
  const Run& operator[](size_t i) const { return data[i]; }
  const Run* begin() const { return data; }
  const Run* end() const { return data + count; }
};

struct RunCursor {
  size_t run = 0;
  uint64_t pos = 0;  // bytes of runs[run] already taken

  bool at_end(RunView runs) const { return run >= runs.size(); }
  void advance(uint64_t len, uint64_t run_len) {
    pos += len;
    if (pos == run_len) {
      ++run;
      pos = 0;
    }
  }
};

// One RMA segment: bytes [offset, offset + len) of runs[run].
struct Segment {
  size_t run;
  uint64_t offset;
  uint64_t len;
  size_t lpiece;          // local registration piece
  size_t rpiece;          // remote registration piece
  uint64_t rpiece_offset; // of the segment's first remote byte, within rpiece
};

class Striper {
 public:
  Striper(uint64_t min_chunk, uint64_t max_chunk) : min_chunk_(min_chunk), max_chunk_(max_chunk) {}

  // Every rail of the side with more rails carries a share.
  static size_t pairs(size_t local_rails, size_t remote_rails);
  // The largest segment of a call of `total` bytes: large calls are cut so that every rail
  // pair carries a share; small runs stay whole and go round-robin.
  uint64_t chunk(uint64_t total, size_t pairs) const;

  // The pair the next op takes; next() moves on once that op exists.
  RailPair pair(size_t local_rails, size_t remote_rails) const;
  void next() { ++cursor_; }

  // The segments of one op, taken from `at` on: one segment of at least kGatherBelow, or up
  // to max_iov smaller ones of one local region. A segment never crosses a registration
  // piece on either side, nor exceeds chunk. Returns how many it wrote to out.
  template <typename LocalExtent, typename RemoteExtent>
  static size_t fill(RunCursor& at, RunView runs, LocalExtent local, RemoteExtent remote,
                     uint64_t chunk, size_t max_iov, Segment* out);

  // A staging slot's share of a call, taken from `at` on: runs of one remote region, at
  // most max_runs of them and slot_bytes in all. Appends them to out; returns their bytes.
  static uint64_t fill_slot(RunCursor& at, RunView runs, size_t max_runs, uint64_t slot_bytes,
                            std::vector<Run>& out);

 private:
  uint64_t min_chunk_, max_chunk_;
  uint64_t cursor_ = 0;
};

template <typename LocalExtent, typename RemoteExtent>
size_t Striper::fill(RunCursor& at, RunView runs, LocalExtent local, RemoteExtent remote,
                     uint64_t chunk, size_t max_iov, Segment* out) {
  size_t n = 0;
  uint64_t op_bytes = 0;
  while (!at.at_end(runs) && n < max_iov) {
    const Run& run = runs[at.run];
    const Extent l = local(run.lreg), r = remote(run.rreg);
    const PiecePos lp = piece_at(run.local + at.pos - l.base, l.piece_bytes);
    const PiecePos rp = piece_at(run.remote + at.pos - r.base, r.piece_bytes);
    uint64_t len = std::min(run.len - at.pos, chunk);
    len = std::min(len, std::min(lp.left, rp.left));
    if (n > 0 && (len >= kGatherBelow || op_bytes + len > chunk || run.lreg != runs[out[0].run].lreg)) break;
    out[n++] = {at.run, at.pos, len, lp.index, rp.index, rp.offset};
    op_bytes += len;
    at.advance(len, run.len);
    if (len >= kGatherBelow) break;
  }
  return n;
}

}  // namespace p2p::core
