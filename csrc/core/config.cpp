#include "core/config.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "common/error.h"
#include "fabric/profile.h"

namespace p2p::core {
namespace {

[[noreturn]] void malformed(const char* env, const char* text, const char* expected) {
  P2P_THROW(ErrorKind::Value, env, " must be ", expected, ", not '", text, "'");
}

void parse(const char* env, const char* text, std::string& out) { out = text; }

void parse(const char* env, const char* text, bool& out) {
  if (std::strcmp(text, "0") && std::strcmp(text, "1")) malformed(env, text, "0 or 1");
  out = text[0] == '1';
}

template <typename Int>
void parse(const char* env, const char* text, Int& out) {
  char* end = nullptr;
  errno = 0;
  const long long value = std::strtoll(text, &end, 10);
  while (end && *end == ' ') ++end;
  if (errno || end == text || *end || (std::is_unsigned<Int>::value && value < 0)) malformed(env, text, "an integer");
  out = static_cast<Int>(value);
}

void parse(const char* env, const char* text, double& out) {
  char* end = nullptr;
  out = std::strtod(text, &end);
  if (end == text || *end) malformed(env, text, "a number");
}

// NOTE: snprintf, not an ostringstream: on the GPU machine (torch 2.11, gcc 13) streaming a
// double while the module loads crashed inside libstdc++'s formatting.
std::string text_of(const std::string& value) { return value; }

template <typename T>
std::string text_of(T value) {
  char out[32];
  if constexpr (std::is_floating_point<T>::value)
    std::snprintf(out, sizeof out, "%g", static_cast<double>(value));
  else if constexpr (std::is_signed<T>::value)
    std::snprintf(out, sizeof out, "%lld", static_cast<long long>(value));
  else
    std::snprintf(out, sizeof out, "%llu", static_cast<unsigned long long>(value));
  return out;
}

std::string text_of(bool value) { return value ? "1" : "0"; }

}  // namespace

std::vector<SettingInfo> setting_table() {
  std::vector<SettingInfo> rows;
#define P2P_SETTING_ROW(key, field, type, value, env) rows.push_back({#key, env ? env : "", text_of(type(value))});
  P2P_SETTINGS(P2P_SETTING_ROW)
#undef P2P_SETTING_ROW
  return rows;
}

void read_environment(Config& config, const std::set<std::string>& given) {
  auto read = [&](const char* key, const char* env, auto& field) {
    if (!env || given.count(key)) return;
    const char* text = std::getenv(env);
    if (!text || !*text) return;  // an empty variable is no choice
    parse(env, text, field);
    config.chosen.insert(key);
  };
#define P2P_SETTING_READ(key, field, type, value, env) read(#key, env, config.field);
  P2P_SETTINGS(P2P_SETTING_READ)
#undef P2P_SETTING_READ
}

void apply_provider_defaults(Config& config, const std::string& provider) {
  const fabric::Profile& p = fabric::profile(provider);
  if (p.max_chunk && !config.chosen.count("max_chunk_bytes")) config.max_chunk = p.max_chunk;
}

void validate(const Config& c) {
  for (size_t v : {c.slot_bytes, c.max_chunk, c.min_chunk, c.piece_bytes, c.batch})
    P2P_CHECK(v != 0, ErrorKind::Value, "sizes and batch must be positive");
  P2P_CHECK(c.timeout_s > 0 && c.peer_timeout_s > 0, ErrorKind::Value, "timeouts must be positive");
  P2P_CHECK(c.cma_threads >= -1 && c.cma_threads <= 64, ErrorKind::Value, "cma_threads must be -1 (auto) to 64, not ",
            c.cma_threads);
  P2P_CHECK(c.cma_ptrace == "peers" || c.cma_ptrace == "any", ErrorKind::Value,
            "TORCH_P2P_CMA_PTRACE must be \"peers\" or \"any\", not \"", c.cma_ptrace, "\"");
  P2P_CHECK(c.profile.empty() || c.profile == "efa", ErrorKind::Value, "TORCH_P2P_PROFILE must be \"efa\" or unset, not \"",
            c.profile, "\"");
}

fabric::QueryOptions Config::query_options() const {
  fabric::QueryOptions o;
  unsigned major = 0, minor = 0;
  if (std::sscanf(fi_version.c_str(), "%u.%u", &major, &minor) == 2) o.api_version = FI_VERSION(major, minor);
  o.manual_progress = progress == "manual";
  o.shm_fast = shm_fast;
  o.hmem_device_only = hmem_device_only;
  o.efa_shaped = profile == "efa";
  return o;
}

LogLevel log_level_from_environment() {
  const char* env = std::getenv("TORCH_P2P_LOG");
  if (!env) return LogLevel::Warn;
  if (!std::strcmp(env, "error")) return LogLevel::Error;
  if (!std::strcmp(env, "info")) return LogLevel::Info;
  if (!std::strcmp(env, "debug")) return LogLevel::Debug;
  return LogLevel::Warn;
}

Setup::Setup(Config resolved) : config(std::move(resolved)) {
  validate(config);
  offer = std::make_shared<const fabric::Offer>(
      fabric::query(config.provider, config.cuda() && config.data_path != DataPath::Staged, config.query_options()));
  apply_provider_defaults(config, offer->provider);
  // No op may carry more than the provider's largest RMA (efa-direct: about 1 GiB). A limit
  // of a few KiB describes sends (an MTU), not RMA, and is not taken for one.
  if (offer->max_rma() >= (size_t{64} << 10)) {
    config.max_chunk = std::min<size_t>(config.max_chunk, offer->max_rma());
    config.min_chunk = std::min(config.min_chunk, config.max_chunk);
  }
  validate(config);
}

void Setup::place(std::vector<std::string> domains, int cpu, std::vector<int> node_cpus) {
  config.domains = std::move(domains);
  config.cpu = cpu;
  config.node_cpus = std::move(node_cpus);
  // A pinned worker owns its core and busy-polls.
  if (cpu >= 0 && !config.chosen.count("spin_us")) config.spin_us = -1;
}

}  // namespace p2p::core
