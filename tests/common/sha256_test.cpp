// SHA-256 against FIPS 180-4's examples and HMAC-SHA-256 against RFC 4231's test cases.
#include "common/sha256.h"

#include <gtest/gtest.h>

#include <set>

namespace tessera {
namespace {

TEST(Sha256Test, FipsExamples) {
  EXPECT_EQ(to_hex(sha256("")), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(to_hex(sha256("abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(to_hex(sha256("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(to_hex(sha256(std::string(1000000, 'a'))),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(Sha256Test, PiecewiseUpdatesEqualOneUpdate) {
  std::string text;
  for (int i = 0; i < 1000; ++i) text += static_cast<char>(i * 7 + 3);
  for (size_t piece : {1u, 3u, 55u, 56u, 63u, 64u, 65u, 200u}) {
    Sha256 h;
    for (size_t at = 0; at < text.size(); at += piece) {
      h.update(std::string_view(text).substr(at, piece));
    }
    EXPECT_EQ(to_hex(h.finish()), to_hex(sha256(text))) << "pieces of " << piece;
  }
}

TEST(HmacSha256Test, Rfc4231Cases) {
  EXPECT_EQ(to_hex(hmac_sha256(std::string(20, '\x0b'), "Hi There")),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  EXPECT_EQ(to_hex(hmac_sha256("Jefe", "what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  // A key longer than a block is hashed first.
  EXPECT_EQ(to_hex(hmac_sha256(std::string(131, '\xaa'),
                               "Test Using Larger Than Block-Size Key - Hash Key First")),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
}

TEST(ConstantTimeEqualTest, ComparesBytesAndLengths) {
  EXPECT_TRUE(constant_time_equal("", ""));
  EXPECT_TRUE(constant_time_equal("secret", "secret"));
  EXPECT_FALSE(constant_time_equal("secret", "secreT"));
  EXPECT_FALSE(constant_time_equal("Secret", "secret"));
  EXPECT_FALSE(constant_time_equal("secret", "secret2"));
  EXPECT_FALSE(constant_time_equal(std::string("a\0b", 3), std::string("a\0c", 3)));
}

TEST(RandomBytesTest, FreshEachTime) {
  std::set<std::string> seen;
  for (int i = 0; i < 64; ++i) {
    auto r = random_bytes(16);
    ASSERT_TRUE(r) << r.status().to_string();
    ASSERT_EQ(r->size(), 16u);
    seen.insert(*r);
  }
  EXPECT_EQ(seen.size(), 64u);
  EXPECT_EQ(to_hex(std::string("\x00\x7f\xff", 3)), "007fff");
}

}  // namespace
}  // namespace tessera
