#include "core/runs.h"

#include <algorithm>
#include <numeric>

namespace p2p::core {
namespace {

struct Dim {
  int64_t size, local, remote;  // strides in elements
};

// Drops size-1 dimensions and merges a dimension into its inner neighbour where both sides
// step over it as if it were contiguous with it. Into `out`, a buffer the caller reuses (a call
// may hold thousands of views: allocations were most of a small view's cost).
void coalesce(Ints shape, const int64_t* ls, const int64_t* rs, std::vector<Dim>& out) {
  out.clear();
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == 1) continue;
    const Dim d{shape[i], ls[i], rs[i]};
    if (!out.empty()) {
      Dim& outer = out.back();
      if (outer.local == d.local * d.size && outer.remote == d.remote * d.size) {
        outer = {outer.size * d.size, d.local, d.remote};
        continue;
      }
    }
    out.push_back(d);
  }
}

}  // namespace

void append_runs(Ints shape, Strided local, Strided remote, int64_t elem,
                 uint32_t lreg, uint32_t rreg, std::vector<Run>& out) {
  for (int64_t s : shape)
    if (s == 0) return;
  thread_local std::vector<Dim> dims;
  thread_local std::vector<int64_t> index;
  coalesce(shape, local.strides, remote.strides, dims);
  // The innermost dimension is one run when both sides are dense along it.
  uint64_t run_len = elem;
  if (!dims.empty() && dims.back().local == 1 && dims.back().remote == 1) {
    run_len = dims.back().size * elem;
    dims.pop_back();
  }
  index.assign(dims.size(), 0);
  uint64_t loff = 0, roff = 0;  // byte offsets of the current run
  while (true) {
    const uint64_t l = local.base + loff, r = remote.base + roff;
    Run* last = out.empty() ? nullptr : &out.back();
    if (last && last->lreg == lreg && last->rreg == rreg && last->local + last->len == l &&
        last->remote + last->len == r)
      last->len += run_len;
    else
      out.push_back({l, r, run_len, lreg, rreg});
    // Odometer over the outer dimensions, innermost fastest.
    size_t d = dims.size();
    while (d > 0) {
      --d;
      Dim& dim = dims[d];
      if (++index[d] < dim.size) {
        loff += dim.local * elem;
        roff += dim.remote * elem;
        break;
      }
      loff -= (dim.size - 1) * dim.local * elem;
      roff -= (dim.size - 1) * dim.remote * elem;
      index[d] = 0;
      if (d == 0) return;
    }
    if (dims.empty()) return;
  }
}

int64_t repeated_id(const int64_t* ids, size_t n, int64_t count, std::vector<uint8_t>& table) {
  const int64_t most = std::max<int64_t>(int64_t{1} << 20, 16 * static_cast<int64_t>(n));
  if (count <= most) {
    if (table.size() < static_cast<size_t>(count)) table.resize(count);
    size_t k = 0;
    for (; k < n && !table[ids[k]]; ++k) table[ids[k]] = 1;
    const int64_t twice = k < n ? ids[k] : -1;
    for (size_t j = 0; j < k; ++j) table[ids[j]] = 0;
    return twice;
  }
  std::vector<int64_t> sorted(ids, ids + n);
  std::sort(sorted.begin(), sorted.end());
  const auto twice = std::adjacent_find(sorted.begin(), sorted.end());
  return twice == sorted.end() ? -1 : *twice;
}

void append_page_runs(const PageRuns& p, const int64_t* ids, std::vector<Run>& out) {
  // Grow geometrically: a call holds one entry per layer, and reserving each entry's exact
  // size would copy the runs so far once per entry.
  if (out.capacity() < out.size() + p.n) out.reserve(std::max(out.size() + p.n, 2 * out.capacity()));
  for_each_page(p, ids, [&](uint64_t l, uint64_t r) {
    Run* last = out.empty() ? nullptr : &out.back();
    if (last && last->lreg == p.lreg && last->rreg == p.rreg && last->local + last->len == l &&
        last->remote + last->len == r)
      last->len += p.bytes;
    else
      out.push_back({l, r, p.bytes, p.lreg, p.rreg});
  });
}

PageGrid page_grid(const int64_t* offsets, size_t n, int64_t* ids) {
  // The distances' power-of-two part from one OR, their odd part by gcd only until it is 1,
  // which random pages reach within a few: loops without divisions, which cost most of it.
  int64_t origin = offsets[0], top = offsets[0];
  for (size_t k = 1; k < n; ++k) {
    origin = std::min(origin, offsets[k]);
    top = std::max(top, offsets[k]);
  }
  uint64_t bits = 0;
  for (size_t k = 0; k < n; ++k) bits |= static_cast<uint64_t>(offsets[k] - origin);
  if (bits == 0) {  // all at one place
    std::fill(ids, ids + n, 0);
    return {origin, 1, 1};
  }
  const int shift = __builtin_ctzll(bits);
  uint64_t odd = 0;
  for (size_t k = 0; k < n && odd != 1; ++k) odd = std::gcd(odd, static_cast<uint64_t>(offsets[k] - origin) >> shift);
  const int64_t stride = static_cast<int64_t>(odd << shift);
  if (odd == 1) {
    for (size_t k = 0; k < n; ++k) ids[k] = (offsets[k] - origin) >> shift;
  } else {
    for (size_t k = 0; k < n; ++k) ids[k] = (offsets[k] - origin) / stride;
  }
  return {origin, stride, (top - origin) / stride + 1};
}

uint64_t extent_bytes(Ints shape, const int64_t* strides, int64_t elem) {
  uint64_t last = 0;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == 0) return 0;
    last += static_cast<uint64_t>(shape[i] - 1) * static_cast<uint64_t>(strides[i]);
  }
  return (last + 1) * static_cast<uint64_t>(elem);
}

bool self_overlapping(Ints shape, const int64_t* strides) {
  // Sorted by stride, a view has distinct addresses when each stride clears the span of
  // every smaller one: the usual non-overlap test for strided layouts.
  thread_local std::vector<size_t> order;
  order.clear();
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == 0) return false;
    if (shape[i] > 1) order.push_back(i);
  }
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return strides[a] < strides[b]; });
  int64_t span = 1;  // elements covered by the dimensions so far
  for (size_t i : order) {
    if (strides[i] < span) return true;
    span += strides[i] * (shape[i] - 1);
  }
  return false;
}

}  // namespace p2p::core
