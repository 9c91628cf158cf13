// ViewPages: a list of view pairs as users write it first ([cache[i] for i in mine],
// [remote[j] for j in theirs]) taken as pages. Consecutive pairs whose local views share a
// storage, dispatch keys, shape, strides and dtype and whose remote views share a region, shape,
// strides and dtype become one pages entry on each side (page ids and a page stride: page_grid),
// read straight from the TensorImpls and RemoteViews, without a Python object per field; other
// pairs stay views. The grouped call moves the same bytes in the same order.
//
// A grouped entry can be turned back into its views (page_views), for the engine's view-by-view
// checks where it refuses the pages (pages refuse a destination page named twice, where views of
// one place are allowed). Plain functions of the caller's thread.
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "engine/remote_view.h"

namespace p2p::engine {

// One pair as the caller found it: null where that side cannot be a page (not a plain tensor,
// not an exact RemoteTensor).
struct ViewPair {
  const at::Tensor* local;
  const RemoteView* remote;
};

// The end of the run of pairs from `first` that are pages of pairs[first]'s tensor and remote
// view (first + 1 where pairs[first] starts none: its tensor must be strided, on the CPU or a
// GPU, with a storage, no Python dispatch and not empty). `loffsets` and `roffsets` get the run's
// storage offsets (elements).
size_t page_run(const ViewPair* pairs, size_t n, size_t first, std::vector<int64_t>& loffsets,
                std::vector<int64_t>& roffsets);

// One pages entry of each side: the first local view restrided into a tensor whose dimension 0
// steps over the pages (page dimension 0 of `local`, ids `lids`), and likewise the first remote
// view.
struct PagedPair {
  at::Tensor local, lids;
  std::shared_ptr<RemoteView> remote;
  at::Tensor rids;
};
PagedPair paged_pair(const at::Tensor& l0, const RemoteView& r0, const int64_t* loffsets,
                     const int64_t* roffsets, size_t n);

// The views a PagedPair was made of, in order, appended to `local` and `remote`.
void page_views(const PagedPair& p, std::vector<at::Tensor>& local, std::vector<std::shared_ptr<RemoteView>>& remote);

// Whether paged_pair builds its tensor directly (a TensorImpl on the views' storage, as
// as_strided makes it, without the dispatcher's cost per entry) rather than through
// at::as_strided. Decided once, by comparing the two on a probe tensor: a torch whose as_strided
// makes something else gets as_strided.
bool direct_views();
void disable_direct_views();  // for tests of the as_strided path

}  // namespace p2p::engine
