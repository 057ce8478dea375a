#include "driver/chat/py_string.h"

#include <algorithm>
#include <cstdio>

#include "driver/chat/value.h"

namespace tessera::chat::jinja::py {
namespace {

bool is_ascii(std::string_view s) {
  return std::all_of(s.begin(), s.end(),
                     [](char c) { return static_cast<unsigned char>(c) < 0x80; });
}

char32_t simple_upper(char32_t c) {
  if (c < 0x80) return (c >= 'a' && c <= 'z') ? c - 32 : c;
  if ((c >= 0xE0 && c <= 0xFE && c != 0xF7)) return c - 0x20;
  if (c == 0xFF) return 0x178;
  if (c == 0xB5) return 0x39C;
  if (c >= 0x100 && c <= 0x17F) {
    if (c == 0x131) return 'I';
    if (c == 0x17F) return 'S';
    if (c == 0x130 || c == 0x138 || c == 0x149 || c == 0x178) return c;
    bool odd_upper = (c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17E);
    bool is_lower = odd_upper ? (c % 2 == 0) : (c % 2 == 1);
    return is_lower ? c - 1 : c;
  }
  if (c >= 0x3B1 && c <= 0x3C9) return c == 0x3C2 ? 0x3A3 : c - 0x20;
  if (c == 0x3AC) return 0x386;
  if (c >= 0x3AD && c <= 0x3AF) return c - 0x25;
  if (c == 0x3CC) return 0x38C;
  if (c == 0x3CD || c == 0x3CE) return c - 0x3F;
  if (c >= 0x430 && c <= 0x44F) return c - 0x20;
  if (c >= 0x450 && c <= 0x45F) return c - 0x50;
  return c;
}

char32_t simple_lower(char32_t c) {
  if (c < 0x80) return (c >= 'A' && c <= 'Z') ? c + 32 : c;
  if (c >= 0xC0 && c <= 0xDE && c != 0xD7) return c + 0x20;
  if (c == 0x178) return 0xFF;
  if (c >= 0x100 && c <= 0x17F) {
    if (c == 0x130 || c == 0x131 || c == 0x138 || c == 0x149 || c == 0x17F) return c;
    bool odd_upper = (c >= 0x139 && c <= 0x148) || (c >= 0x179 && c <= 0x17E);
    bool is_upper = odd_upper ? (c % 2 == 1) : (c % 2 == 0);
    return is_upper ? c + 1 : c;
  }
  if (c >= 0x391 && c <= 0x3A9 && c != 0x3A2) return c + 0x20;
  if (c == 0x386) return 0x3AC;
  if (c >= 0x388 && c <= 0x38A) return c + 0x25;
  if (c == 0x38C) return 0x3CC;
  if (c == 0x38E || c == 0x38F) return c + 0x3F;
  if (c >= 0x410 && c <= 0x42F) return c + 0x20;
  if (c >= 0x400 && c <= 0x40F) return c + 0x50;
  return c;
}

bool is_cased(char32_t c) { return simple_upper(c) != c || simple_lower(c) != c || c == 0xDF; }

void append_upper(std::string& out, char32_t c) {
  if (c == 0xDF) {
    out += "SS";
  } else {
    append_utf8(out, simple_upper(c));
  }
}

bool is_line_break(char32_t c) {
  return c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || (c >= 0x1C && c <= 0x1E) ||
         c == 0x85 || c == 0x2028 || c == 0x2029;
}

// Python's str.isprintable() for the characters Jinja templates meet; unassigned code points
// count as printable.
bool is_printable(char32_t c) {
  if (c < 0x20 || c == 0x7F) return false;
  if (c < 0x7F) return true;
  if (c <= 0xA0 || c == 0xAD) return false;
  if (c == 0x1680 || (c >= 0x2000 && c <= 0x200F) || (c >= 0x2028 && c <= 0x202F)) return false;
  if ((c >= 0x205F && c <= 0x206F) || c == 0x3000 || c == 0xFEFF) return false;
  if ((c >= 0xD800 && c <= 0xDFFF) || (c >= 0xE000 && c <= 0xF8FF)) return false;
  if (c >= 0xFFF9 && c <= 0xFFFB) return false;
  return true;
}

bool in_chars(char32_t c, const std::u32string& chars) {
  return chars.find(c) != std::u32string::npos;
}

}  // namespace

void append_utf8(std::string& out, char32_t c) {
  if (c >= 0xDC80 && c <= 0xDCFF) {  // an undecodable byte, restored
    out += static_cast<char>(c - 0xDC00);
  } else if (c < 0x80) {
    out += static_cast<char>(c);
  } else if (c < 0x800) {
    out += static_cast<char>(0xC0 | (c >> 6));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += static_cast<char>(0xE0 | (c >> 12));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (c >> 18));
    out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  }
}

char32_t decode_at(std::string_view s, size_t i, size_t* size) {
  auto b = static_cast<unsigned char>(s[i]);
  int extra = b < 0x80 ? 0 : (b >> 5) == 6 ? 1 : (b >> 4) == 14 ? 2 : (b >> 3) == 30 ? 3 : -1;
  char32_t c = extra == 0 ? b : extra == 1 ? (b & 0x1F) : extra == 2 ? (b & 0x0F) : (b & 0x07);
  bool ok = extra >= 0 && i + extra < s.size();
  for (int k = 1; ok && k <= extra; ++k) {
    auto cont = static_cast<unsigned char>(s[i + k]);
    if ((cont & 0xC0) != 0x80) ok = false;
    c = (c << 6) | (cont & 0x3F);
  }
  static constexpr char32_t kMin[] = {0, 0x80, 0x800, 0x10000};
  if (ok && extra > 0 && (c < kMin[extra] || c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF))) {
    ok = false;
  }
  if (!ok) {
    *size = 1;
    return 0xDC00 + b;
  }
  *size = extra + 1;
  return c;
}

std::u32string decode(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    size_t n = 0;
    out += decode_at(s, i, &n);
    i += n;
  }
  return out;
}

std::string encode(std::u32string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : s) append_utf8(out, c);
  return out;
}

size_t length(std::string_view s) {
  if (is_ascii(s)) return s.size();
  return decode(s).size();
}

bool is_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
         c == 0x205F || c == 0x3000;
}

bool all_space(std::string_view s) {
  if (s.empty()) return false;
  std::u32string d = decode(s);
  return std::all_of(d.begin(), d.end(), is_space);
}

std::string strip(std::string_view s, const std::optional<std::string>& chars, bool left,
                  bool right) {
  // Walks in from both ends, decoding only the characters it strips.
  std::u32string set = chars ? decode(*chars) : std::u32string();
  auto strip_it = [&](char32_t c) { return chars ? in_chars(c, set) : is_space(c); };
  size_t b = 0, e = s.size();
  while (left && b < e) {
    size_t len = 0;
    char32_t c = decode_at(s.substr(0, e), b, &len);
    if (!strip_it(c)) break;
    b += len;
  }
  while (right && e > b) {
    size_t len = 1;  // the last character: a whole sequence ending at e, or one stray byte
    char32_t c = 0xDC00 + static_cast<unsigned char>(s[e - 1]);
    for (size_t k = 2; k <= 4 && k <= e - b; ++k) {
      size_t n = 0;
      char32_t d = decode_at(s.substr(0, e), e - k, &n);
      if (n == k) {
        c = d;
        len = k;
        break;
      }
    }
    if (len == 1 && static_cast<unsigned char>(s[e - 1]) < 0x80) c = s[e - 1];
    if (!strip_it(c)) break;
    e -= len;
  }
  return std::string(s.substr(b, e - b));
}

std::vector<std::string> split(std::string_view s, const std::optional<std::string>& sep,
                               int64_t maxsplit) {
  std::vector<std::string> out;
  if (sep) {
    if (sep->empty()) throw RenderError("empty separator");
    size_t pos = 0;
    while (maxsplit < 0 || static_cast<int64_t>(out.size()) < maxsplit) {
      size_t hit = s.find(*sep, pos);
      if (hit == std::string_view::npos) break;
      out.emplace_back(s.substr(pos, hit - pos));
      pos = hit + sep->size();
    }
    out.emplace_back(s.substr(pos));
    return out;
  }
  std::u32string d = decode(s);
  size_t i = 0;
  while (true) {
    while (i < d.size() && is_space(d[i])) ++i;
    if (i == d.size()) break;
    if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {
      out.push_back(encode(std::u32string_view(d).substr(i)));
      break;
    }
    size_t j = i;
    while (j < d.size() && !is_space(d[j])) ++j;
    out.push_back(encode(std::u32string_view(d).substr(i, j - i)));
    i = j;
  }
  return out;
}

std::vector<std::string> rsplit(std::string_view s, const std::optional<std::string>& sep,
                                int64_t maxsplit) {
  std::vector<std::string> out;
  if (sep) {
    if (sep->empty()) throw RenderError("empty separator");
    size_t end = s.size();
    while (maxsplit < 0 || static_cast<int64_t>(out.size()) < maxsplit) {
      if (end < sep->size()) break;
      size_t hit = s.rfind(*sep, end - sep->size());
      if (hit == std::string_view::npos) break;
      out.emplace_back(s.substr(hit + sep->size(), end - hit - sep->size()));
      end = hit;
    }
    out.emplace_back(s.substr(0, end));
  } else {
    std::u32string d = decode(s);
    size_t j = d.size();
    while (true) {
      while (j > 0 && is_space(d[j - 1])) --j;
      if (j == 0) break;
      if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {
        out.push_back(encode(std::u32string_view(d).substr(0, j)));
        break;
      }
      size_t i = j;
      while (i > 0 && !is_space(d[i - 1])) --i;
      out.push_back(encode(std::u32string_view(d).substr(i, j - i)));
      j = i;
    }
  }
  std::reverse(out.begin(), out.end());
  return out;
}

std::vector<std::string> splitlines(std::string_view s, bool keepends) {
  std::u32string d = decode(s);
  std::vector<std::string> out;
  size_t start = 0, i = 0;
  while (i < d.size()) {
    if (!is_line_break(d[i])) {
      ++i;
      continue;
    }
    size_t eol = i + ((d[i] == '\r' && i + 1 < d.size() && d[i + 1] == '\n') ? 2 : 1);
    out.push_back(encode(std::u32string_view(d).substr(start, (keepends ? eol : i) - start)));
    start = i = eol;
  }
  if (start < d.size()) out.push_back(encode(std::u32string_view(d).substr(start)));
  return out;
}

std::string replace(std::string_view s, std::string_view old_part, std::string_view new_part,
                    int64_t count) {
  std::string out;
  if (old_part.empty()) {
    std::u32string d = decode(s);
    int64_t done = 0;
    for (size_t i = 0; i <= d.size(); ++i) {
      if (count < 0 || done < count) {
        out += new_part;
        ++done;
      }
      if (i < d.size()) append_utf8(out, d[i]);
    }
    return out;
  }
  size_t pos = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    size_t hit = s.find(old_part, pos);
    if (hit == std::string_view::npos) break;
    out += s.substr(pos, hit - pos);
    out += new_part;
    if (out.size() > kMaxStringBytes) throw RenderError("string too long");
    pos = hit + old_part.size();
    ++done;
  }
  out += s.substr(pos);
  return out;
}

int64_t find(std::string_view s, std::string_view part, bool reverse) {
  size_t hit = reverse ? s.rfind(part) : s.find(part);
  if (hit == std::string_view::npos) return -1;
  return static_cast<int64_t>(length(s.substr(0, hit)));
}

int64_t count(std::string_view s, std::string_view part) {
  if (part.empty()) return static_cast<int64_t>(length(s)) + 1;
  int64_t n = 0;
  for (size_t pos = s.find(part); pos != std::string_view::npos;
       pos = s.find(part, pos + part.size())) {
    ++n;
  }
  return n;
}

std::string upper(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : decode(s)) append_upper(out, c);
  return out;
}

std::string lower(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : decode(s)) append_utf8(out, simple_lower(c));
  return out;
}

std::string capitalize(std::string_view s) {
  std::u32string d = decode(s);
  std::string out;
  for (size_t i = 0; i < d.size(); ++i) {
    if (i == 0) {
      append_upper(out, d[i]);
    } else {
      append_utf8(out, simple_lower(d[i]));
    }
  }
  return out;
}

std::string title(std::string_view s) {
  std::string out;
  bool previous_cased = false;
  for (char32_t c : decode(s)) {
    if (previous_cased) {
      append_utf8(out, simple_lower(c));
    } else {
      append_upper(out, c);
    }
    previous_cased = is_cased(c);
  }
  return out;
}

std::string repr(std::string_view s) {
  std::u32string d = decode(s);
  bool has_single = d.find(U'\'') != std::u32string::npos;
  bool has_double = d.find(U'"') != std::u32string::npos;
  char quote = (has_single && !has_double) ? '"' : '\'';
  std::string out(1, quote);
  for (char32_t c : d) {
    char buf[16];
    if (c == static_cast<char32_t>(quote) || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (is_printable(c)) {
      append_utf8(out, c);
    } else {
      if (c < 0x100) {
        std::snprintf(buf, sizeof(buf), "\\x%02x", static_cast<unsigned>(c));
      } else if (c < 0x10000) {
        std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
      } else {
        std::snprintf(buf, sizeof(buf), "\\U%08x", static_cast<unsigned>(c));
      }
      out += buf;
    }
  }
  out += quote;
  return out;
}

SliceIndices resolve_slice(int64_t length, std::optional<int64_t> start,
                           std::optional<int64_t> stop, int64_t step) {
  auto adjust = [&](std::optional<int64_t> v, int64_t fallback) {
    if (!v) return fallback;
    int64_t x = *v;
    if (x < 0) {
      x += length;
      if (x < 0) x = step < 0 ? -1 : 0;
    } else if (x >= length) {
      x = step < 0 ? length - 1 : length;
    }
    return x;
  };
  SliceIndices r;
  r.step = step;
  r.start = adjust(start, step < 0 ? length - 1 : 0);
  int64_t end = adjust(stop, step < 0 ? -1 : length);
  if (step < 0) {
    r.count = end < r.start ? (r.start - end - 1) / (-step) + 1 : 0;
  } else {
    r.count = r.start < end ? (end - r.start - 1) / step + 1 : 0;
  }
  return r;
}

std::string slice(std::string_view s, const SliceIndices& indices) {
  if (is_ascii(s)) {
    std::string out;
    out.reserve(indices.count);
    for (int64_t k = 0; k < indices.count; ++k) out += s[indices.start + k * indices.step];
    return out;
  }
  std::u32string d = decode(s);
  std::string out;
  for (int64_t k = 0; k < indices.count; ++k) append_utf8(out, d[indices.start + k * indices.step]);
  return out;
}

}  // namespace tessera::chat::jinja::py
