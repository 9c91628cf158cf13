#include "common/error.h"

#include <rdma/fi_errno.h>

#include <cstring>

namespace p2p {

std::string fi_error_name(int err) {
  // libfabric reuses errno values below FI_ERRNO_OFFSET; name the common ones so that
  // messages are searchable, and always add libfabric's own text.
  const char* name = nullptr;
  switch (err) {
    case FI_EAGAIN: name = "FI_EAGAIN"; break;
    case FI_ENOMEM: name = "FI_ENOMEM"; break;
    case FI_EINVAL: name = "FI_EINVAL"; break;
    case FI_ENOSYS: name = "FI_ENOSYS"; break;
    case FI_ENODATA: name = "FI_ENODATA"; break;
    case FI_EMSGSIZE: name = "FI_EMSGSIZE"; break;
    case FI_ECONNREFUSED: name = "FI_ECONNREFUSED"; break;
    case FI_ECONNRESET: name = "FI_ECONNRESET"; break;
    case FI_ECONNABORTED: name = "FI_ECONNABORTED"; break;
    case FI_ENOTCONN: name = "FI_ENOTCONN"; break;
    case FI_EHOSTUNREACH: name = "FI_EHOSTUNREACH"; break;
    case FI_ECANCELED: name = "FI_ECANCELED"; break;
    case FI_EACCES: name = "FI_EACCES"; break;
    case FI_ENOKEY: name = "FI_ENOKEY"; break;
    case FI_EKEYREJECTED: name = "FI_EKEYREJECTED"; break;
    case FI_EIO: name = "FI_EIO"; break;
    case FI_EAVAIL: name = "FI_EAVAIL"; break;
    case FI_ETIMEDOUT: name = "FI_ETIMEDOUT"; break;
    case FI_EBUSY: name = "FI_EBUSY"; break;
    case FI_EPERM: name = "FI_EPERM"; break;
    default: break;
  }
  return cat(name ? name : "error ", name ? "" : std::to_string(err), " (", fi_strerror(err), ")");
}

bool is_error_kind(uint8_t value) {
  switch (value) {
#define P2P_ERROR_KIND_VALUE(kind, value, exception) case value:
    P2P_ERROR_KINDS(P2P_ERROR_KIND_VALUE)
#undef P2P_ERROR_KIND_VALUE
    return true;
  }
  return false;
}

void throw_error(ErrorKind kind, const std::string& message, const char* file, int line) {
  // Bad input is the caller's to fix: no source location. Everything else names where it
  // was raised so that a report can be traced.
  if (kind == ErrorKind::Value || kind == ErrorKind::Index) throw Error(kind, message);
  const char* base = std::strstr(file, "csrc/");
  throw Error(kind, cat(message, " [", base ? base : file, ":", line, "]"));
}

}  // namespace p2p
