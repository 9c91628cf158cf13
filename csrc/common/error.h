// Errors in three tiers:
//  - p2p::Error is thrown on API and setup paths; the bindings turn it into the Python
//    exception its kind names (torch_p2p/errors.py).
//  - p2p::Status travels inside a completion on worker paths and becomes a Future's exception.
//  - P2P_ASSERT guards invariants; a failure is a bug in this library, never bad input.
#pragma once

#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace p2p {

// Every error kind, with its number and the Python exception it becomes (a builtin, or a
// class of torch_p2p/errors.py). The one table of kinds: the enum below and errors.py's
// table (through _C.error_kinds), by which the bindings and the futures raise, come from it.
#define P2P_ERROR_KINDS(X)                                                                  \
  X(None, 0, "")                                                                            \
  X(Generic, 1, "P2PError")                                                                 \
  X(Value, 2, "ValueError")     /* bad argument */                                          \
  X(Index, 3, "IndexError")                                                                 \
  X(Peer, 4, "PeerError")       /* the peer is dead, left, restarted or unreachable */      \
  X(Timeout, 5, "TimeoutError") /* torch_p2p.TimeoutError, a P2PError */                    \
  X(Closed, 6, "ClosedError")   /* engine or region closed */                               \
  X(Cancelled, 7, "CancelledError")                                                         \
  X(Remote, 8, "RemoteError")   /* the peer refused the operation (bounds, access, key) */

enum class ErrorKind : uint8_t {
#define P2P_ERROR_KIND_ENUM(kind, value, exception) kind = value,
  P2P_ERROR_KINDS(P2P_ERROR_KIND_ENUM)
#undef P2P_ERROR_KIND_ENUM
};

// Whether a byte from the wire names a kind.
bool is_error_kind(uint8_t value);

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

struct Status {
  ErrorKind kind = ErrorKind::None;
  std::string message;

  bool ok() const { return kind == ErrorKind::None; }
  static Status error(ErrorKind kind, std::string message) { return {kind, std::move(message)}; }
};

// cat("a", 1, "b") -> "a1b": builds messages. NOTE: no iostreams anywhere in this library:
// with a toolchain that links libstdc++ statically into the extension (as on the GPU
// machine), std::ostringstream crashes on the process's global locale, which belongs to the
// other libstdc++.
namespace detail {
inline void append(std::string& s, std::string_view v) { s.append(v); }
inline void append(std::string& s, const char* v) { s.append(v ? v : "(null)"); }
inline void append(std::string& s, char v) { s.push_back(v); }
template <typename T>
std::enable_if_t<std::is_integral_v<T>> append(std::string& s, T v) {
  s.append(std::to_string(v));
}
template <typename T>
std::enable_if_t<std::is_floating_point_v<T>> append(std::string& s, T v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", static_cast<double>(v));
  s.append(buf);
}
}  // namespace detail

template <typename... Args>
std::string cat(const Args&... args) {
  std::string out;
  (detail::append(out, args), ...);
  return out;
}

// "1f2e3d4c5b6a7988": how incarnations (engine ids) appear in messages.
inline std::string hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// "FI_ECONNREFUSED (Connection refused)" for a positive libfabric error number.
std::string fi_error_name(int err);

[[noreturn]] void throw_error(ErrorKind kind, const std::string& message, const char* file, int line);

}  // namespace p2p

#define P2P_THROW(kind, ...) ::p2p::throw_error(kind, ::p2p::cat(__VA_ARGS__), __FILE__, __LINE__)
#define P2P_CHECK(cond, kind, ...) \
  do {                             \
    if (!(cond)) P2P_THROW(kind, __VA_ARGS__); \
  } while (0)
// For libfabric calls that return 0 or a negative error number on setup paths.
#define FI_CHECK(call, ...)                                                                      \
  do {                                                                                           \
    const int fi_rc_ = static_cast<int>(call);                                                   \
    if (fi_rc_ < 0)                                                                              \
      P2P_THROW(::p2p::ErrorKind::Generic, __VA_ARGS__, ": ", ::p2p::fi_error_name(-fi_rc_)); \
  } while (0)
#define P2P_ASSERT(cond)                                                                       \
  do {                                                                                         \
    if (!(cond)) ::p2p::throw_error(::p2p::ErrorKind::Generic, "internal error: " #cond,      \
                                    __FILE__, __LINE__);                                       \
  } while (0)
