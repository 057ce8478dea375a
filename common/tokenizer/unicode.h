// Unicode helpers the tokenizer needs: UTF-8 decoding and repair, the GPT-2 byte-to-unicode
// map of byte-level BPE, White_Space, and NFC normalisation.
//
// NFC follows Unicode's algorithm (full canonical decomposition, canonical ordering, canonical
// composition with Hangul done algorithmically) over tables generated from Python's
// unicodedata by scripts/gen_nfc_tables.py (its Unicode version is nfc_unicode_version()).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace tessera::tokenizer {

inline constexpr uint32_t kReplacementChar = 0xFFFD;

// Decodes the code point starting at text[pos] and advances pos past it. An ill-formed
// sequence decodes to kReplacementChar and pos advances past its maximal subpart (the bytes that
// could start a valid sequence, at least one), the way Rust's String::from_utf8_lossy does.
// Precondition: pos < text.size().
uint32_t next_code_point(std::string_view text, size_t& pos);

// Appends the UTF-8 encoding of `cp` (a scalar value; surrogates and > 0x10FFFF become U+FFFD).
void append_utf8(std::string& out, uint32_t cp);

// True if `text` is well-formed UTF-8.
bool is_valid_utf8(std::string_view text);

// `bytes` with each ill-formed subsequence replaced by U+FFFD, as from_utf8_lossy does.
std::string utf8_lossy(std::string_view bytes);

// Unicode White_Space (what Rust's and Oniguruma's \s match).
bool is_whitespace(uint32_t cp);

// GPT-2's reversible byte-to-unicode map: printable Latin-1 bytes map to themselves, the others
// to U+0100 and up. byte_to_unicode(b) is the UTF-8 of the char for byte b.
std::string_view byte_to_unicode(uint8_t byte);
// The byte whose char is `cp`, or -1 if `cp` is not in the map.
int unicode_to_byte(uint32_t cp);

// Canonical combining class of `cp` (0 for starters).
uint8_t combining_class(uint32_t cp);

// NFC normalisation of well-formed UTF-8 (ill-formed input is repaired first, as utf8_lossy).
std::string nfc(std::string_view text);
// True when nfc(text) == text is certain from the quick check (no code point whose NFC quick
// check is No or Maybe, combining classes in order). False means "run nfc() to know".
bool is_nfc_quick(std::string_view text);
// Unicode version of the NFC tables, e.g. "14.0.0".
std::string_view nfc_unicode_version();

}  // namespace tessera::tokenizer
