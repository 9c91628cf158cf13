// Little-endian byte encoding shared by engine addresses, RemoteTensor handles and control
// messages. ByteReader checks every read against the end of its input and throws a
// ValueError-kind Error instead: bytes from a peer or a user are never trusted.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>

#include "common/error.h"

namespace p2p {

uint32_t crc32(const void* data, size_t len);

class ByteWriter {
 public:
  template <typename T>
  void put(T value) {
    static_assert(std::is_trivially_copyable_v<T>);
    out_.append(reinterpret_cast<const char*>(&value), sizeof(T));
  }
  void put_bytes(std::string_view bytes) {  // length-prefixed (u32)
    put<uint32_t>(static_cast<uint32_t>(bytes.size()));
    out_.append(bytes);
  }
  // Appends a CRC32 of everything written so far; ByteReader::check_crc verifies it.
  void seal() { put<uint32_t>(crc32(out_.data(), out_.size())); }
  std::string& str() { return out_; }

 private:
  std::string out_;
};

class ByteReader {
 public:
  ByteReader(std::string_view in, const char* what) : in_(in), what_(what) {}

  template <typename T>
  T get() {
    static_assert(std::is_trivially_copyable_v<T>);
    need(sizeof(T));
    T value;
    std::memcpy(&value, in_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return value;
  }
  std::string_view get_bytes(size_t max_len) {
    const uint32_t len = get<uint32_t>();
    if (len > max_len) fail("a field is longer than allowed");
    need(len);
    std::string_view bytes = in_.substr(pos_, len);
    pos_ += len;
    return bytes;
  }
  std::string_view get_raw(size_t len) {
    need(len);
    std::string_view bytes = in_.substr(pos_, len);
    pos_ += len;
    return bytes;
  }
  // Checks the trailing CRC32 and drops it from the readable input. Call first.
  void check_crc() {
    if (in_.size() < 4) fail("too short");
    uint32_t stored;
    std::memcpy(&stored, in_.data() + in_.size() - 4, 4);
    in_ = in_.substr(0, in_.size() - 4);
    if (crc32(in_.data(), in_.size()) != stored) fail("checksum mismatch (corrupted or truncated)");
  }
  void expect_end() {
    if (pos_ != in_.size()) fail("trailing bytes");
  }
  size_t remaining() const { return in_.size() - pos_; }
  [[noreturn]] void fail(const char* why) const {
    throw Error(ErrorKind::Value, cat("invalid ", what_, ": ", why));
  }

 private:
  void need(size_t n) const {
    if (in_.size() - pos_ < n) fail("truncated");
  }
  std::string_view in_;
  size_t pos_ = 0;
  const char* what_;
};

}  // namespace p2p
