#include "core/host.h"

#include <sys/stat.h>

#include <cstdio>

#include "common/error.h"

namespace p2p::core {

std::string host_identity() {
  char boot[64] = {0};
  FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r");
  if (!f) return {};
  const size_t n = std::fread(boot, 1, sizeof boot - 1, f);
  std::fclose(f);
  std::string id(boot, n);
  while (!id.empty() && (id.back() == '\n' || id.back() == ' ')) id.pop_back();
  struct stat ns {};
  if (id.empty() || stat("/proc/self/ns/pid", &ns) != 0) return {};
  return cat(id, "/", static_cast<uint64_t>(ns.st_ino));
}

}  // namespace p2p::core
