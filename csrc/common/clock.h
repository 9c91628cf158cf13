// The one clock of the engine's timers and deadlines: seconds on the monotonic clock.
#pragma once

#include <chrono>

namespace p2p {

inline double now() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

}  // namespace p2p
