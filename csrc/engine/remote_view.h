// RemoteView: the data behind torch_p2p.RemoteTensor, a strided view of a remote region.
// Views share their region; indexing (done in Python) makes new views, validated here.
#pragma once

#include <c10/core/ScalarType.h>

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/address.h"

namespace p2p::engine {

struct RemoteView {
  std::shared_ptr<const RemoteRegion> region;
  c10::ScalarType dtype = c10::ScalarType::Byte;
  std::vector<int64_t> shape, strides;  // strides in elements
  int64_t offset = 0;                   // in elements from the region's first byte

  int64_t elem() const { return static_cast<int64_t>(c10::elementSize(dtype)); }
  // Throws ValueError unless shape, strides and offset describe bytes inside the region.
  void validate() const;
  std::shared_ptr<RemoteView> view(int64_t offset, std::vector<int64_t> shape,
                                   std::vector<int64_t> strides) const;
  std::string encode() const;
  static std::shared_ptr<RemoteView> decode(std::string_view bytes);
};

}  // namespace p2p::engine
