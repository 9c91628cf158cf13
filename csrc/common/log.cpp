#include "common/log.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace p2p {

static LogLevel configured_level() {
  const char* env = std::getenv("TORCH_P2P_LOG");
  if (!env) return LogLevel::Warn;
  if (!std::strcmp(env, "error")) return LogLevel::Error;
  if (!std::strcmp(env, "info")) return LogLevel::Info;
  if (!std::strcmp(env, "debug")) return LogLevel::Debug;
  return LogLevel::Warn;
}

bool log_enabled(LogLevel level) {
  static const LogLevel threshold = configured_level();
  return static_cast<int>(level) <= static_cast<int>(threshold);
}

void log_line(LogLevel level, const std::string& line) {
  static const char* names[] = {"error", "warn", "info", "debug"};
  // One fprintf per line keeps lines from different threads whole.
  std::fprintf(stderr, "[torch_p2p %s] %s\n", names[static_cast<int>(level)], line.c_str());
}

}  // namespace p2p
