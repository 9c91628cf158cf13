// Which host and pid namespace this process runs in, for the same-host routes.
#pragma once

#include <string>

namespace p2p::core {

// "boot id/pid namespace": processes that share it can map each other's CUDA memory by IPC
// and watch each other by pid. Empty if unknown.
std::string host_identity();

}  // namespace p2p::core
