#include "core/striper.h"

#include <algorithm>

namespace p2p::core {

uint64_t round_page(uint64_t n) { return (n + 4095) & ~uint64_t{4095}; }

uint64_t slot_size(uint64_t configured) { return round_page(std::max<uint64_t>(configured, 4096)); }

PiecePos piece_at(uint64_t offset, uint64_t piece_bytes) {
  const uint64_t index = offset / piece_bytes, within = offset - index * piece_bytes;
  return {static_cast<size_t>(index), within, piece_bytes - within};
}

size_t Striper::pairs(size_t local_rails, size_t remote_rails) { return std::max(local_rails, remote_rails); }

uint64_t Striper::chunk(uint64_t total, size_t pairs) const {
  return std::clamp<uint64_t>((total + pairs - 1) / pairs, min_chunk_, max_chunk_);
}

RailPair Striper::pair(size_t local_rails, size_t remote_rails) const {
  const size_t pair = cursor_ % pairs(local_rails, remote_rails);
  return {static_cast<uint16_t>(pair % local_rails), static_cast<uint16_t>(pair % remote_rails)};
}

uint64_t Striper::fill_slot(RunCursor& at, RunView runs, size_t max_runs, uint64_t slot_bytes,
                            std::vector<Run>& out) {
  if (at.at_end(runs)) return 0;
  const uint32_t rreg = runs[at.run].rreg;  // a StageReq addresses one region of its owner
  uint64_t bytes = 0;
  size_t taken = 0;
  while (!at.at_end(runs) && taken < max_runs && bytes < slot_bytes) {
    const Run& run = runs[at.run];
    if (run.rreg != rreg) break;
    const uint64_t len = std::min(run.len - at.pos, slot_bytes - bytes);
    out.push_back({run.local + at.pos, run.remote + at.pos, len, run.lreg, run.rreg});
    bytes += len;
    ++taken;
    at.advance(len, run.len);
  }
  return bytes;
}

}  // namespace p2p::core
