#include "common/tokenizer/unicode.h"

#include <gtest/gtest.h>

#include "tests/tokenizer/tokenizer_test_util.h"

namespace tessera::tokenizer {
namespace {

TEST(Utf8Test, LossyReplacesMaximalSubparts) {
  EXPECT_EQ(utf8_lossy("abc"), "abc");
  EXPECT_EQ(utf8_lossy("\xE4\xB8"), "\xEF\xBF\xBD");  // truncated: one U+FFFD
  EXPECT_EQ(utf8_lossy("\xF0\x9F\x98"
                       "A"),
            "\xEF\xBF\xBD"
            "A");                                                 // truncated emoji
  EXPECT_EQ(utf8_lossy("\xFF\xFE"), "\xEF\xBF\xBD\xEF\xBF\xBD");  // never valid: one each
  EXPECT_EQ(utf8_lossy("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // surrogate
  EXPECT_EQ(utf8_lossy("\xC0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD");                  // overlong
  EXPECT_EQ(utf8_lossy("\xEF\xBF\xBD"), "\xEF\xBF\xBD");  // a real U+FFFD stays
  EXPECT_TRUE(is_valid_utf8("日本 😀"));
  EXPECT_FALSE(is_valid_utf8("\xE6\x97"));
}

TEST(ByteLevelTest, MapIsGpt2s) {
  EXPECT_EQ(byte_to_unicode(' '), "Ġ");
  EXPECT_EQ(byte_to_unicode('\n'), "Ċ");
  EXPECT_EQ(byte_to_unicode('a'), "a");
  EXPECT_EQ(byte_to_unicode(0xE4), "ä");
  for (int b = 0; b < 256; ++b) {
    std::string_view s = byte_to_unicode(static_cast<uint8_t>(b));
    size_t pos = 0;
    EXPECT_EQ(unicode_to_byte(next_code_point(s, pos)), b);
    EXPECT_EQ(pos, s.size());
  }
  EXPECT_EQ(unicode_to_byte(0x4E2D), -1);
}

TEST(WhitespaceTest, UnicodeWhiteSpace) {
  for (uint32_t cp : {0x20u, 0x09u, 0x0Au, 0x0Du, 0x85u, 0xA0u, 0x2003u, 0x3000u, 0x2028u}) {
    EXPECT_TRUE(is_whitespace(cp)) << cp;
  }
  for (uint32_t cp : {0x41u, 0x200Bu, 0x180Eu, 0x00u}) EXPECT_FALSE(is_whitespace(cp)) << cp;
}

TEST(NfcTest, ComposesAndReorders) {
  EXPECT_EQ(nfc("Cafe\u0301"), "Café");
  EXPECT_EQ(nfc("\u1100\u1161\u11A8"), "각");  // Hangul LVT
  EXPECT_EQ(nfc("\uAC00\u11A8"), "각");        // LV + T
  EXPECT_EQ(nfc("a\u0323\u0302"), "\u1EAD");   // ậ
  EXPECT_EQ(nfc("a\u0302\u0323"), "\u1EAD");   // reordered first
  EXPECT_EQ(nfc("Tie\u0302\u0301ng Vie\u0323\u0302t"), "Tiếng Việt");
  EXPECT_EQ(nfc("\u212B"), "\u00C5");               // singleton: Angstrom sign
  EXPECT_EQ(nfc("\u0958"), "\u0915\u093C");         // composition exclusion
  EXPECT_EQ(nfc("\u0301a"), "\u0301a");             // leading combining mark
  EXPECT_EQ(nfc("a\u0301\u0301"), "\u00E1\u0301");  // second is blocked
  EXPECT_EQ(nfc("ｶ ＡＢＣ ﬁ ①"), "ｶ ＡＢＣ ﬁ ①");   // compatibility: untouched
  EXPECT_EQ(nfc("中文 English"), "中文 English");
  EXPECT_TRUE(is_nfc_quick("Café 中文"));
  EXPECT_FALSE(is_nfc_quick("Cafe\u0301"));
  EXPECT_FALSE(nfc_unicode_version().empty());
}

TEST(NfcTest, Hangul) {
  // Every modern syllable survives NFC unchanged, and its decomposition composes back.
  for (uint32_t s = 0xAC00; s < 0xAC00 + 11172; s += 97) {
    std::string syllable;
    append_utf8(syllable, s);
    EXPECT_EQ(nfc(syllable), syllable);
    uint32_t index = s - 0xAC00;
    std::string jamo;
    append_utf8(jamo, 0x1100 + index / 588);
    append_utf8(jamo, 0x1161 + (index % 588) / 28);
    if (index % 28 != 0) append_utf8(jamo, 0x11A7 + index % 28);
    EXPECT_EQ(nfc(jamo), syllable);
  }
}

}  // namespace
}  // namespace tessera::tokenizer
