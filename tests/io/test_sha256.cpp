// SHA-256 against the FIPS 180-4 / NIST example vectors.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "detlogp/error.hpp"
#include "io/sha256.hpp"

namespace {

using detlogp::io::Sha256;

std::string sha_hex(const std::string& message) { return Sha256::hex(Sha256::of(message.data(), message.size())); }

TEST(Sha256, EmptyMessage) {
  EXPECT_EQ(sha_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
}

TEST(Sha256, Abc) { EXPECT_EQ(sha_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"); }

TEST(Sha256, Message448Bits) {
  EXPECT_EQ(sha_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
}

TEST(Sha256, Message896Bits) {
  EXPECT_EQ(sha_hex("abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqrlmnopqrsm"
                    "nopqrstnopqrstu"),
            "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1");
}

TEST(Sha256, OneMillionA) {
  const std::string million(1000000, 'a');
  EXPECT_EQ(sha_hex(million), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

// Streaming in uneven pieces (crossing block boundaries at every offset) gives the one-shot digest.
TEST(Sha256, IncrementalUpdatesMatchOneShot) {
  const std::string million(1000000, 'a');
  Sha256 by_bytes;
  for (char c : million) by_bytes.update(&c, 1);
  EXPECT_EQ(Sha256::hex(by_bytes.finish()), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");

  std::string message;
  for (int i = 0; i < 300; ++i) message += static_cast<char>(i * 7 + 3);
  const std::string expected = sha_hex(message);
  for (size_t chunk : {1u, 3u, 55u, 56u, 63u, 64u, 65u, 127u}) {
    Sha256 h;
    for (size_t pos = 0; pos < message.size(); pos += chunk)
      h.update(message.data() + pos, std::min(chunk, message.size() - pos));
    EXPECT_EQ(Sha256::hex(h.finish()), expected) << "chunk " << chunk;
  }
}

// Messages whose padding lands on either side of the 56-byte boundary.
TEST(Sha256, PaddingBoundaries) {
  EXPECT_EQ(sha_hex(std::string(55, 'a')), "9f4390f8d30c2dd92ec9f095b65e2b9ae9b0a925a5258e241c9f1e910f734318");
  EXPECT_EQ(sha_hex(std::string(56, 'a')), "b35439a4ac6f0948b6d6f9e3c6af0f5f590ce20f1bde7090ef7970686ec6738a");
  EXPECT_EQ(sha_hex(std::string(64, 'a')), "ffe054fe7ae0cb6dc65c3af9b61d5209f439851db43d0ba5997337df154668eb");
}

TEST(Sha256, UpdateAfterFinishIsAnError) {
  Sha256 h;
  h.update("x", 1);
  h.finish();
  EXPECT_THROW(h.update("y", 1), detlogp::Error);
}

}  // namespace
