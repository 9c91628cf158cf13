// Log lines go to stderr as "[torch_p2p] ..." when their level is at or below the process's
// level (warn until set_log_level; the module sets it from TORCH_P2P_LOG when it loads, see
// core/config.h). Any thread may log.
#pragma once

#include "common/error.h"

namespace p2p {

enum class LogLevel : int { Error = 0, Warn = 1, Info = 2, Debug = 3 };

void set_log_level(LogLevel level);
bool log_enabled(LogLevel level);
void log_line(LogLevel level, const std::string& line);

}  // namespace p2p

#define P2P_LOG(level, ...)                                                      \
  do {                                                                           \
    if (::p2p::log_enabled(::p2p::LogLevel::level))                              \
      ::p2p::log_line(::p2p::LogLevel::level, ::p2p::cat(__VA_ARGS__));          \
  } while (0)
