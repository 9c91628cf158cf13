// Config: every setting of one engine, resolved once at set-up and passed down; nothing below
// the bindings reads the environment. A setting comes from the constructor's arguments, else
// its TORCH_P2P_* variable, else the provider's default (provider_defaults), else the table's.
// Python reads the table through _C.settings() (names, variables, defaults), so the defaults
// are written here only. The three placement variables (TORCH_P2P_DOMAINS, _NUM_RAILS, _CPUS)
// belong to the rail and core choice in torch_p2p/topology.py, which hands its plan down
// through Setup::place.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "common/log.h"
#include "fabric/info.h"

namespace p2p::core {

enum class DataPath : uint8_t { Auto, Direct, Staged };

// X(key, field, type, default, environment variable or nullptr). `key` is the Python name.
#define P2P_SETTINGS(X)                                                                                  \
  X(provider, provider, std::string, "", "TORCH_P2P_PROVIDER") /* "" = best available */                 \
  X(timeout, timeout_s, double, 120.0, nullptr)                /* default deadline of an operation */    \
  X(peer_timeout, peer_timeout_s, double, 10.0, nullptr)       /* silence after which a peer is dead */  \
  X(staging_bytes, staging_bytes, size_t, size_t{64} << 20, "TORCH_P2P_STAGING_BYTES")                   \
  X(staging_slot_bytes, slot_bytes, size_t, size_t{4} << 20, "TORCH_P2P_STAGING_SLOT_BYTES")             \
  X(max_chunk_bytes, max_chunk, size_t, size_t{4} << 20, "TORCH_P2P_MAX_CHUNK") /* largest RMA */        \
  X(min_chunk_bytes, min_chunk, size_t, size_t{64} << 10, "TORCH_P2P_MIN_CHUNK") /* split above */       \
  X(mr_piece_bytes, piece_bytes, size_t, size_t{2} << 30, "TORCH_P2P_MR_PIECE_BYTES")                    \
  X(tx_depth, tx_depth, size_t, 0, "TORCH_P2P_TX_DEPTH")       /* 0 = the provider's tx size */          \
  X(post_batch, batch, size_t, 32, "TORCH_P2P_POST_BATCH")     /* posts per FI_MORE batch */             \
  X(spin_us, spin_us, int, 1000, "TORCH_P2P_SPIN_US")          /* -1 when pinned: see Setup::place */    \
  X(rail_threads, rail_threads, int, -1, "TORCH_P2P_RAIL_THREADS") /* -1: one per thread-safe rail */    \
  X(ipc, ipc, bool, true, "TORCH_P2P_IPC")                     /* same-host CUDA peers use CUDA IPC */   \
  X(ipc_copy_engine_bytes, ipc_copy_engine_bytes, uint64_t, uint64_t{16} << 20,                          \
    "TORCH_P2P_IPC_COPY_ENGINE_BYTES")                         /* IPC runs this big use copy engines */  \
  X(cma, cma, bool, true, "TORCH_P2P_CMA")                     /* same-host host memory: cma route */    \
  X(cma_threads, cma_threads, int, -1, "TORCH_P2P_CMA_THREADS") /* -1: node/2 up to 8, one per core below 8 (0: worker copies) */\
  X(cma_map, cma_map, bool, true, "TORCH_P2P_CMA_MAP")        /* cma maps peers' shared-memory files */ \
  X(cma_inline_bytes, cma_inline, uint64_t, uint64_t{256} << 10, "TORCH_P2P_CMA_INLINE") /* mapped calls this small: the caller copies (0: never) */\
  X(cma_ptrace, cma_ptrace, std::string, "peers", "TORCH_P2P_CMA_PTRACE") /* Yama consent: "any" opens us */ \
  X(fi_version, fi_version, std::string, "", "TORCH_P2P_FI_VERSION") /* "1.18": the API version asked */ \
  X(progress, progress, std::string, "auto", "TORCH_P2P_PROGRESS")   /* "manual": no provider threads */ \
  X(shm_fast, shm_fast, bool, false, "TORCH_P2P_SHM_FAST")     /* shm's unchecked fast RMA */            \
  X(hmem_device_only, hmem_device_only, bool, true, "TORCH_P2P_HMEM_DEVICE_ONLY") /* shm CUDA IPC */    \
  X(profile, profile, std::string, "", "TORCH_P2P_PROFILE")    /* "efa": EFA's limits on any provider */ \
  X(test_route, test_route, bool, false, "TORCH_P2P_TEST_ROUTE") /* tests: routes/loopback/ */

struct Config {
#define P2P_SETTING_FIELD(key, field, type, value, env) type field = value;
  P2P_SETTINGS(P2P_SETTING_FIELD)
#undef P2P_SETTING_FIELD

  // Set by the caller, not the table.
  int cuda_device = -1;              // the engine's GPU, -1 for a host engine
  uint16_t port = 0;                 // rail i listens on port + i (IP providers), 0 = any
  DataPath data_path = DataPath::Auto;
  // The placement (Setup::place).
  std::vector<std::string> domains;  // one libfabric domain name per rail (may repeat)
  int cpu = -1;                      // core to pin the thread to, -1 = no pinning
  std::vector<int> node_cpus;        // the cores of cpu's NUMA node; empty: unknown
  // Fixed.
  size_t recv_buffers = 256;
  size_t send_buffers = 256;

  std::set<std::string> chosen;      // keys given as arguments or in the environment

  bool cuda() const { return cuda_device >= 0; }
  // The libfabric query options these settings ask for.
  fabric::QueryOptions query_options() const;
};

// One row of the table as Python sees it: (key, variable or "", default as text).
struct SettingInfo {
  std::string key;
  std::string variable;
  std::string default_text;
};
std::vector<SettingInfo> setting_table();

// Reads the variable of every setting whose key `given` does not hold into `config`, and
// records them in config.chosen. Throws a ValueError-kind Error naming a malformed variable.
void read_environment(Config& config, const std::set<std::string>& given);

// Settings whose best value depends on the provider, where nobody chose one.
void apply_provider_defaults(Config& config, const std::string& provider);

// Throws a ValueError-kind Error for settings no engine can run with.
void validate(const Config& config);

// TORCH_P2P_LOG: error, warn (default), info or debug. Process-wide, read when the module loads.
LogLevel log_level_from_environment();

// What set-up decides before the worker starts: the settings, and the provider's offer,
// queried once. Python plans rails and a core from offer->nics(), then calls place().
struct Setup {
  Config config;
  std::shared_ptr<const fabric::Offer> offer;

  // Resolves the remaining settings and queries the provider.
  explicit Setup(Config resolved);
  // The rails (domain names) and the core the worker runs on, with that core's NUMA node.
  void place(std::vector<std::string> domains, int cpu, std::vector<int> node_cpus);
};

}  // namespace p2p::core
