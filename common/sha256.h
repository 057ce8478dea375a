// SHA-256 (FIPS 180-4) and HMAC-SHA-256 (RFC 2104), plus the few helpers authentication needs:
// random bytes from the kernel, hex, and a comparison whose time does not depend on where two
// strings differ. Written for the cluster handshake (protocol/auth.h); small and dependency-free
// so every process (daemon, actor, driver) can use it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"

namespace tessera {

using Sha256Digest = std::array<uint8_t, 32>;

// Incremental SHA-256: update() any number of times, then finish() once.
class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t bytes);
  void update(std::string_view text) { update(text.data(), text.size()); }
  // The digest of everything given to update(). The object must not be used afterwards.
  Sha256Digest finish();

 private:
  void compress(const uint8_t* block);  // one 64-byte block
  std::array<uint32_t, 8> state_;
  std::array<uint8_t, 64> buffer_{};
  size_t buffered_ = 0;  // bytes in buffer_
  uint64_t total_ = 0;   // bytes hashed so far
};

Sha256Digest sha256(std::string_view data);

// HMAC-SHA-256 of `message` under `key` (any length; keys over 64 bytes are hashed first).
Sha256Digest hmac_sha256(std::string_view key, std::string_view message);

// True when `a` and `b` are equal; the time taken depends only on their lengths.
bool constant_time_equal(std::string_view a, std::string_view b);

// `bytes` bytes from getrandom(2). INTERNAL if the kernel cannot supply them.
Expected<std::string> random_bytes(size_t bytes);

// Lower-case hex of raw bytes.
std::string to_hex(std::string_view bytes);
std::string to_hex(const Sha256Digest& digest);
// The digest as raw bytes.
std::string digest_bytes(const Sha256Digest& digest);

}  // namespace tessera
