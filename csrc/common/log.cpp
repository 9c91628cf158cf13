#include "common/log.h"

#include <atomic>
#include <cstdio>

namespace p2p {
namespace {

std::atomic<int> threshold{static_cast<int>(LogLevel::Warn)};

}  // namespace

void set_log_level(LogLevel level) { threshold.store(static_cast<int>(level), std::memory_order_relaxed); }

bool log_enabled(LogLevel level) {
  return static_cast<int>(level) <= threshold.load(std::memory_order_relaxed);
}

void log_line(LogLevel level, const std::string& line) {
  static const char* names[] = {"error", "warn", "info", "debug"};
  // One fprintf per line keeps lines from different threads whole.
  std::fprintf(stderr, "[torch_p2p %s] %s\n", names[static_cast<int>(level)], line.c_str());
}

}  // namespace p2p
