// RemoteView: the data behind torch_p2p.RemoteTensor, a strided view of a remote region.
// Views share their region; indexing and view() make new views here (the bindings parse the
// Python index), validated against the region.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/SmallVector.h>

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/address.h"

namespace p2p::engine {

using namespace core;

// One item of a basic index (remote[...]) as the bindings parse it from Python.
struct IndexItem {
  enum class Kind : uint8_t { NewAxis, Ellipsis, Slice, Int };
  Kind kind;
  // Slice: start, stop, step as PySlice_Unpack gives them (None already resolved, clamped to
  // int64); Int: the index in start.
  int64_t start = 0, stop = 0, step = 1;
};

// A view's or a page's shape or strides: inline up to six dimensions, so that a call's parse
// reads a view pair's dimensions from the view itself and makes no heap block per entry
// (hundreds of views a call: a heap read each was most of a pair's cost).
using Dims = c10::SmallVector<int64_t, 6>;

struct RemoteView {
  std::shared_ptr<const RemoteRegion> region;
  c10::ScalarType dtype = c10::ScalarType::Byte;
  Dims shape, strides;  // strides in elements
  int64_t offset = 0;                   // in elements from the region's first byte

  int64_t elem() const { return static_cast<int64_t>(c10::elementSize(dtype)); }
  // Throws ValueError unless shape, strides and offset describe bytes inside the region.
  void validate() const;
  std::shared_ptr<RemoteView> view(int64_t offset, c10::IntArrayRef shape, c10::IntArrayRef strides) const;
  // remote[items]: torch's view for basic indexing. IndexError for an index out of range or
  // too many indices, ValueError for a step that is not positive.
  std::shared_ptr<RemoteView> index(const IndexItem* items, size_t n) const;
  // remote.view(shape): torch.Tensor.view's rules (one -1 inferred; the strides must allow
  // it without a copy), ValueError otherwise.
  std::shared_ptr<RemoteView> reshaped(std::vector<int64_t> shape) const;
  std::string encode() const;
  static std::shared_ptr<RemoteView> decode(std::string_view bytes);
};

}  // namespace p2p::engine
