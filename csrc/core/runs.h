// Decomposition of a strided view pair into contiguous byte runs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace p2p::core {

// `len` bytes at local address `local` correspond to `len` bytes at byte offset `remote` of
// the remote storage. lreg/rreg index the transfer's local and remote region lists.
struct Run {
  uint64_t local;
  uint64_t remote;
  uint64_t len;
  uint32_t lreg;
  uint32_t rreg;
};

// The pages of one write_slices entry when each page is one run on both sides (a KV block):
// page k moves `bytes` between local + ids[k] * local_stride and the remote byte offset
// remote + ids[n + k] * remote_stride, `ids` being the transfer's page ids from `first` on.
// Kept as pages until a route needs runs: the IPC route's kernel reads the ids itself.
struct PageRuns {
  uint64_t local;
  int64_t local_stride;
  uint64_t remote;
  int64_t remote_stride;
  uint64_t bytes;
  size_t first, n;
  uint32_t lreg, rreg;
};

// Appends the runs of `pages`, merging pages that continue each other on both sides.
void append_page_runs(const PageRuns& pages, const int64_t* ids, std::vector<Run>& out);

// Calls fn(local address, remote offset) for each page of `pages`, in order (ids: the call's
// page ids, as append_page_runs takes them).
template <class Fn>
void for_each_page(const PageRuns& p, const int64_t* ids, Fn&& fn) {
  const int64_t* lids = ids + p.first;
  const int64_t* rids = lids + p.n;
  for (size_t k = 0; k < p.n; ++k)
    fn(p.local + static_cast<uint64_t>(lids[k] * p.local_stride), p.remote + static_cast<uint64_t>(rids[k] * p.remote_stride));
}

// An id of ids[0..n) (each in [0, count)) that appears twice, or -1. Where count is not far
// above n, `table` holds a byte per id (grown to count, left all zero); past that a sorted copy
// decides, so that a few pages of a huge tensor cost no huge table.
int64_t repeated_id(const int64_t* ids, size_t n, int64_t count, std::vector<uint8_t>& table);

// n views of one shape, strides and dtype at these offsets (elements) as the pages of one
// tensor: offsets[k] == origin + ids[k] * stride with ids[k] in [0, count). The stride is the
// gcd of the offsets' distances (1 when they are all equal), so that evenly spaced views are
// pages of that spacing. Offsets must not be negative.
struct PageGrid {
  int64_t origin, stride, count;
};
PageGrid page_grid(const int64_t* offsets, size_t n, int64_t* ids);

struct Strided {
  uint64_t base;            // byte address (local) or byte offset (remote) of element 0
  const int64_t* strides;   // in elements
};

// Read-only int64 elements (a shape, strides): Ints, which the extension
// cannot use while older torch builds it as C++17. Made from any container of int64_t with
// data() and size() (std::vector, c10::SmallVector, c10::IntArrayRef).
struct Ints {
  const int64_t* ptr = nullptr;
  size_t count = 0;
  template <class C, class = decltype(std::declval<const C&>().data())>
  Ints(const C& c) : ptr(c.data()), count(c.size()) {}  // NOLINT: converts
  size_t size() const { return count; }
  int64_t operator[](size_t i) const { return ptr[i]; }
  const int64_t* begin() const { return ptr; }
  const int64_t* end() const { return ptr + count; }
};

// Appends the runs that copy every element of `shape` from one side to the other, merging
// runs that continue each other on both sides. Dimensions are coalesced first, so a
// contiguous view of any rank is one run.
void append_runs(Ints shape, Strided local, Strided remote, int64_t elem,
                 uint32_t lreg, uint32_t rreg, std::vector<Run>& out);

// Bytes spanned from element 0 to one past the last element (0 for an empty view).
// Strides must be non-negative.
uint64_t extent_bytes(Ints shape, const int64_t* strides, int64_t elem);

// True when two elements of the view share an address (a stride of 0 on a dimension of
// size > 1, or strides that fold onto each other). Destinations must not overlap.
bool self_overlapping(Ints shape, const int64_t* strides);

}  // namespace p2p::core
