// The CUDA copier (copier.cpp): staging copies on the engine's own stream, completion by events.
#pragma once

#include <memory>

#include "core/copier.h"

namespace p2p::cuda {

// Makes cuda_device current on the calling thread, the worker's, the only one that uses it.
std::unique_ptr<core::Copier> make_copier(int cuda_device);

}  // namespace p2p::cuda
