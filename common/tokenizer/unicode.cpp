#include "common/tokenizer/unicode.h"

#include <algorithm>
#include <array>
#include <tuple>
#include <vector>

namespace tessera::tokenizer {
namespace {

struct CccRange {
  uint32_t first;
  uint32_t last;
  uint8_t ccc;
};
struct DecompEntry {
  uint32_t cp;
  uint16_t offset;  // into kDecompData
  uint8_t length;
};
struct ComposePair {
  uint32_t first;
  uint32_t second;
  uint32_t composite;
};
struct CpRange {
  uint32_t first;
  uint32_t last;
};

#include "common/tokenizer/unicode_nfc_data.inc"

// Hangul syllable arithmetic (Unicode chapter 3.12).
constexpr uint32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr uint32_t kLCount = 19, kVCount = 21, kTCount = 28;
constexpr uint32_t kNCount = kVCount * kTCount, kSCount = kLCount * kNCount;

bool in(uint8_t b, uint8_t lo, uint8_t hi) { return b >= lo && b <= hi; }

// Code points of the GPT-2 byte map, by byte.
constexpr std::array<uint16_t, 256> make_byte_chars() {
  std::array<uint16_t, 256> chars{};
  uint16_t next = 256;
  for (int b = 0; b < 256; ++b) {
    bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    chars[b] = printable ? static_cast<uint16_t>(b) : next++;
  }
  return chars;
}
constexpr std::array<uint16_t, 256> kByteChars = make_byte_chars();

struct ByteStrings {
  std::array<std::array<char, 2>, 256> utf8{};
  std::array<uint8_t, 256> length{};
  std::array<int16_t, 0x144> byte_of{};  // code point -> byte, -1 if none
};

constexpr ByteStrings make_byte_strings() {
  ByteStrings s{};
  for (auto& v : s.byte_of) v = -1;
  for (int b = 0; b < 256; ++b) {
    uint32_t cp = kByteChars[b];
    s.byte_of[cp] = static_cast<int16_t>(b);
    if (cp < 0x80) {
      s.utf8[b][0] = static_cast<char>(cp);
      s.length[b] = 1;
    } else {
      s.utf8[b][0] = static_cast<char>(0xC0 | (cp >> 6));
      s.utf8[b][1] = static_cast<char>(0x80 | (cp & 0x3F));
      s.length[b] = 2;
    }
  }
  return s;
}
constexpr ByteStrings kByteStrings = make_byte_strings();

bool in_ranges(const CpRange* begin, const CpRange* end, uint32_t cp) {
  const CpRange* it =
      std::upper_bound(begin, end, cp, [](uint32_t c, const CpRange& r) { return c < r.first; });
  return it != begin && cp <= (it - 1)->last;
}

// Appends the full canonical decomposition of `cp` to `out`.
void decompose(uint32_t cp, std::vector<uint32_t>& out) {
  if (cp >= kSBase && cp < kSBase + kSCount) {
    uint32_t s = cp - kSBase;
    out.push_back(kLBase + s / kNCount);
    out.push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount != 0) out.push_back(kTBase + s % kTCount);
    return;
  }
  const DecompEntry* end = std::end(kDecompIndex);
  const DecompEntry* it = std::lower_bound(
      std::begin(kDecompIndex), end, cp, [](const DecompEntry& e, uint32_t c) { return e.cp < c; });
  if (it == end || it->cp != cp) {
    out.push_back(cp);
    return;
  }
  out.insert(out.end(), kDecompData + it->offset, kDecompData + it->offset + it->length);
}

// The primary composite of (first, second), or 0 if none.
uint32_t compose_pair(uint32_t first, uint32_t second) {
  if (first >= kLBase && first < kLBase + kLCount && second >= kVBase &&
      second < kVBase + kVCount) {
    return kSBase + ((first - kLBase) * kVCount + (second - kVBase)) * kTCount;
  }
  if (first >= kSBase && first < kSBase + kSCount && (first - kSBase) % kTCount == 0 &&
      second > kTBase && second < kTBase + kTCount) {
    return first + (second - kTBase);
  }
  const ComposePair* end = std::end(kComposePairs);
  const ComposePair* it =
      std::lower_bound(std::begin(kComposePairs), end, first,
                       [](const ComposePair& p, uint32_t f) { return p.first < f; });
  for (; it != end && it->first == first; ++it) {
    if (it->second == second) return it->composite;
  }
  return 0;
}

}  // namespace

uint32_t next_code_point(std::string_view text, size_t& pos) {
  const auto* s = reinterpret_cast<const uint8_t*>(text.data());
  size_t n = text.size();
  uint8_t b0 = s[pos];
  if (b0 < 0x80) {
    ++pos;
    return b0;
  }
  int length;
  uint8_t lo = 0x80, hi = 0xBF;  // range of the second byte
  if (in(b0, 0xC2, 0xDF)) {
    length = 2;
  } else if (in(b0, 0xE0, 0xEF)) {
    length = 3;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (in(b0, 0xF0, 0xF4)) {
    length = 4;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    ++pos;
    return kReplacementChar;
  }
  uint32_t cp = b0 & (0xFF >> (length + 1));
  for (int i = 1; i < length; ++i) {
    size_t at = pos + i;
    uint8_t b = at < n ? s[at] : 0;
    bool ok = at < n && (i == 1 ? in(b, lo, hi) : in(b, 0x80, 0xBF));
    if (!ok) {
      pos = at;  // the maximal subpart ends before the offending byte
      return kReplacementChar;
    }
    cp = (cp << 6) | (b & 0x3F);
  }
  pos += length;
  return cp;
}

void append_utf8(std::string& out, uint32_t cp) {
  if ((cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF) cp = kReplacementChar;
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

bool is_valid_utf8(std::string_view text) {
  size_t pos = 0;
  while (pos < text.size()) {
    if (static_cast<uint8_t>(text[pos]) < 0x80) {
      ++pos;
      continue;
    }
    size_t start = pos;
    uint32_t cp = next_code_point(text, pos);
    // A genuine U+FFFD in the text is 3 bytes long; a replacement for bad bytes is not, or is
    // not EF BF BD.
    if (cp == kReplacementChar && text.substr(start, 3) != "\xEF\xBF\xBD") return false;
  }
  return true;
}

std::string utf8_lossy(std::string_view bytes) {
  if (is_valid_utf8(bytes)) return std::string(bytes);
  std::string out;
  out.reserve(bytes.size() + 8);
  size_t pos = 0;
  while (pos < bytes.size()) append_utf8(out, next_code_point(bytes, pos));
  return out;
}

bool is_whitespace(uint32_t cp) {
  if (cp <= 0x20) return cp == 0x20 || (cp >= 0x09 && cp <= 0x0D);
  switch (cp) {
    case 0x85:
    case 0xA0:
    case 0x1680:
    case 0x2028:
    case 0x2029:
    case 0x202F:
    case 0x205F:
    case 0x3000:
      return true;
    default:
      return cp >= 0x2000 && cp <= 0x200A;
  }
}

std::string_view byte_to_unicode(uint8_t byte) {
  return {kByteStrings.utf8[byte].data(), kByteStrings.length[byte]};
}

int unicode_to_byte(uint32_t cp) {
  return cp < kByteStrings.byte_of.size() ? kByteStrings.byte_of[cp] : -1;
}

uint8_t combining_class(uint32_t cp) {
  if (cp < 0x300) return 0;
  const CccRange* end = std::end(kCccRanges);
  const CccRange* it = std::upper_bound(std::begin(kCccRanges), end, cp,
                                        [](uint32_t c, const CccRange& r) { return c < r.first; });
  return (it != std::begin(kCccRanges) && cp <= (it - 1)->last) ? (it - 1)->ccc : 0;
}

bool is_nfc_quick(std::string_view text) {
  size_t pos = 0;
  uint8_t last_ccc = 0;
  while (pos < text.size()) {
    auto b = static_cast<uint8_t>(text[pos]);
    if (b < 0x80) {
      ++pos;
      last_ccc = 0;
      continue;
    }
    uint32_t cp = next_code_point(text, pos);
    if (cp < 0x300) {
      last_ccc = 0;
      continue;
    }
    uint8_t ccc = combining_class(cp);
    if (ccc != 0 && last_ccc > ccc) return false;
    if (in_ranges(std::begin(kQcNotYesRanges), std::end(kQcNotYesRanges), cp)) return false;
    last_ccc = ccc;
  }
  return true;
}

std::string nfc(std::string_view text) {
  if (is_nfc_quick(text)) return is_valid_utf8(text) ? std::string(text) : utf8_lossy(text);
  // 1. Full canonical decomposition.
  std::vector<uint32_t> cps;
  cps.reserve(text.size());
  size_t pos = 0;
  while (pos < text.size()) decompose(next_code_point(text, pos), cps);
  // 2. Canonical ordering: stable sort of each run of non-starters by combining class.
  std::vector<uint8_t> ccc(cps.size());
  for (size_t i = 0; i < cps.size(); ++i) ccc[i] = combining_class(cps[i]);
  for (size_t i = 0; i < cps.size();) {
    if (ccc[i] == 0) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < cps.size() && ccc[j] != 0) ++j;
    if (j - i > 1) {
      std::vector<std::pair<uint8_t, uint32_t>> run;
      for (size_t k = i; k < j; ++k) run.emplace_back(ccc[k], cps[k]);
      std::stable_sort(run.begin(), run.end(),
                       [](const auto& a, const auto& b) { return a.first < b.first; });
      for (size_t k = i; k < j; ++k) std::tie(ccc[k], cps[k]) = run[k - i];
    }
    i = j;
  }
  // 3. Canonical composition.
  std::string out;
  out.reserve(text.size());
  size_t n = cps.size();
  std::vector<bool> removed(n, false);
  size_t starter = n;  // index of the last starter, n if none
  uint8_t last_ccc = 0;
  for (size_t i = 0; i < n; ++i) {
    uint8_t c = ccc[i];
    if (starter != n) {
      // Blocked when a character left in between (they are non-starters in class order, so
      // last_ccc is the highest) has a class >= this one's; last_ccc == 0: nothing in between.
      bool blocked = last_ccc != 0 && last_ccc >= c;
      if (!blocked) {
        uint32_t composite = compose_pair(cps[starter], cps[i]);
        if (composite != 0) {
          cps[starter] = composite;
          removed[i] = true;
          continue;
        }
      }
    }
    if (c == 0) {
      starter = i;
      last_ccc = 0;
    } else {
      last_ccc = c;
    }
  }
  for (size_t i = 0; i < n; ++i) {
    if (!removed[i]) append_utf8(out, cps[i]);
  }
  return out;
}

std::string_view nfc_unicode_version() { return kUnicodeVersion; }

}  // namespace tessera::tokenizer
