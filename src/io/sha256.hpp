// SHA-256 (FIPS 180-4), used to fingerprint output bytes so runs on different machines can be
// compared by one line of text.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace detlogp::io {

class Sha256 {
 public:
  using Digest = std::array<uint8_t, 32>;

  Sha256();
  void update(const void* data, size_t size);
  // Pads and returns the digest; the object must not be updated afterwards.
  Digest finish();

  static Digest of(const void* data, size_t size);
  static std::string hex(const Digest& digest);

 private:
  void compress(const uint8_t* block);

  std::array<uint32_t, 8> state_;
  std::array<uint8_t, 64> buffer_{};
  size_t buffered_ = 0;
  uint64_t total_bytes_ = 0;
  bool finished_ = false;
};

}  // namespace detlogp::io
