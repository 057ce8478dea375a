#include "driver/chat/lexer.h"

#include <charconv>
#include <cstdlib>

#include "driver/chat/py_string.h"

namespace tessera::chat::jinja {
namespace {

bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_name_start(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
         static_cast<unsigned char>(c) >= 0x80;
}
bool is_name_char(char c) { return is_name_start(c) || is_digit(c); }
int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// Python's "unicode-escape" decoding of a string literal's body, as Jinja applies it.
std::string unescape(std::string_view body, size_t offset) {
  std::string out;
  for (size_t i = 0; i < body.size(); ++i) {
    char c = body[i];
    if (c != '\\') {
      out += c;
      continue;
    }
    if (++i == body.size()) throw SyntaxError{offset, "\\ at end of string"};
    char e = body[i];
    auto hex_escape = [&](int digits) {
      char32_t code = 0;
      for (int k = 0; k < digits; ++k) {
        int h = i + 1 < body.size() ? hex_value(body[i + 1]) : -1;
        if (h < 0) throw SyntaxError{offset, "truncated escape in string literal"};
        code = code * 16 + h;
        ++i;
      }
      if (code > 0x10FFFF) throw SyntaxError{offset, "illegal Unicode character"};
      py::append_utf8(out, code);
    };
    switch (e) {
      case '\n':
        break;  // line continuation
      case '\\':
        out += '\\';
        break;
      case '\'':
        out += '\'';
        break;
      case '"':
        out += '"';
        break;
      case 'a':
        out += '\a';
        break;
      case 'b':
        out += '\b';
        break;
      case 'f':
        out += '\f';
        break;
      case 'n':
        out += '\n';
        break;
      case 'r':
        out += '\r';
        break;
      case 't':
        out += '\t';
        break;
      case 'v':
        out += '\v';
        break;
      case 'x':
        hex_escape(2);
        break;
      case 'u':
        hex_escape(4);
        break;
      case 'U':
        hex_escape(8);
        break;
      case 'N':
        throw SyntaxError{offset, "\\N{...} escapes are not supported"};
      default:
        if (e >= '0' && e <= '7') {
          int code = e - '0';
          for (int k = 0; k < 2 && i + 1 < body.size() && body[i + 1] >= '0' && body[i + 1] <= '7';
               ++k) {
            code = code * 8 + (body[++i] - '0');
          }
          py::append_utf8(out, static_cast<char32_t>(code));
        } else {
          out += '\\';
          out += e;
        }
    }
  }
  return out;
}

class Lexer {
 public:
  explicit Lexer(std::string_view src) : src_(src) {}

  std::vector<Token> run() {
    while (pos_ < src_.size()) {
      size_t tag = find_tag(pos_);
      if (tag == std::string_view::npos) {
        emit(TokenType::kData, std::string(src_.substr(pos_)), pos_);
        break;
      }
      char kind = src_[tag + 1];
      char sign = tag + 2 < src_.size() && (src_[tag + 2] == '-' || src_[tag + 2] == '+')
                      ? src_[tag + 2]
                      : 0;
      size_t raw_end = kind == '%' ? match_raw_begin(tag) : 0;
      std::string text = strip_before(src_.substr(pos_, tag - pos_), sign, kind != '{');
      if (!text.empty()) emit(TokenType::kData, std::move(text), pos_);
      if (kind == '#') {
        lex_comment(tag, sign);
      } else if (raw_end != 0) {
        lex_raw(raw_end);
      } else {
        lex_tag(tag, kind, sign);
      }
    }
    emit(TokenType::kEnd, "", src_.size());
    return std::move(out_);
  }

 private:
  size_t find_tag(size_t from) const {
    for (size_t p = src_.find('{', from); p != std::string_view::npos; p = src_.find('{', p + 1)) {
      if (p + 1 < src_.size() && (src_[p + 1] == '{' || src_[p + 1] == '%' || src_[p + 1] == '#')) {
        return p;
      }
    }
    return std::string_view::npos;
  }

  // One code point's length and whether it is Python whitespace.
  size_t space_at(size_t p) const {
    if (p >= src_.size()) return 0;
    auto b = static_cast<unsigned char>(src_[p]);
    if (b < 0x80) return py::is_space(b) ? 1 : 0;
    size_t len = b >= 0xF0 ? 4 : b >= 0xE0 ? 3 : 2;
    std::u32string c = py::decode(src_.substr(p, len));
    return !c.empty() && py::is_space(c[0]) && py::encode(c.substr(0, 1)).size() == len ? len : 0;
  }
  size_t skip_space(size_t p) const {
    while (size_t n = space_at(p)) p += n;
    return p;
  }

  // Text before a tag, after the tag's '-' marker or lstrip_blocks took what they take.
  std::string strip_before(std::string_view text, char sign, bool lstrip_eligible) const {
    if (sign == '-') return py::strip(text, std::nullopt, false, true);
    if (sign != '+' && lstrip_eligible) {
      size_t line_start = text.rfind('\n');
      line_start = line_start == std::string_view::npos ? 0 : line_start + 1;
      if ((line_start > 0 || line_starting_) && py::all_space(text.substr(line_start))) {
        return std::string(text.substr(0, line_start));
      }
    }
    return std::string(text);
  }

  // The end of a "{% raw %}" tag at `tag`, or 0 when the tag is something else.
  size_t match_raw_begin(size_t tag) const {
    size_t p = tag + 2;
    if (p < src_.size() && (src_[p] == '-' || src_[p] == '+')) ++p;
    p = skip_space(p);
    if (src_.substr(p, 3) != "raw") return 0;
    p = skip_space(p + 3);
    if (src_.substr(p, 3) == "-%}") return skip_space(p + 3);
    if (src_.substr(p, 2) == "%}") return p + 2;
    return 0;
  }

  // Length of a block end ("%}", "-%}", "+%}") at `p` including what it trims after it, or 0.
  size_t match_block_end(size_t p) const {
    if (src_.substr(p, 3) == "+%}") return 3;
    if (src_.substr(p, 3) == "-%}") return skip_space(p + 3) - p;
    if (src_.substr(p, 2) == "%}") return p + 2 < src_.size() && src_[p + 2] == '\n' ? 3 : 2;
    return 0;
  }

  void finish_tag(size_t end) {
    line_starting_ = end > 0 && src_[end - 1] == '\n';
    pos_ = end;
  }

  void lex_comment(size_t tag, char sign) {
    size_t content = tag + 2 + (sign ? 1 : 0);
    size_t close = src_.find("#}", content);
    if (close == std::string_view::npos) throw SyntaxError{tag, "Missing end of comment tag"};
    size_t end = close + 2;
    if (close > content && src_[close - 1] == '-') {
      end = skip_space(end);
    } else if (!(close > content && src_[close - 1] == '+') && end < src_.size() &&
               src_[end] == '\n') {
      ++end;
    }
    finish_tag(end);
  }

  void lex_raw(size_t body) {
    finish_tag(body);
    for (size_t p = src_.find("{%", body); p != std::string_view::npos;
         p = src_.find("{%", p + 1)) {
      char sign =
          p + 2 < src_.size() && (src_[p + 2] == '-' || src_[p + 2] == '+') ? src_[p + 2] : 0;
      size_t q = skip_space(p + 2 + (sign ? 1 : 0));
      if (src_.substr(q, 6) != "endraw") continue;
      q = skip_space(q + 6);
      size_t end_len = match_block_end(q);
      if (end_len == 0) continue;
      std::string text = strip_before(src_.substr(body, p - body), sign, true);
      if (!text.empty()) emit(TokenType::kData, std::move(text), body);
      finish_tag(q + end_len);
      return;
    }
    throw SyntaxError{body, "Missing end of raw directive"};
  }

  void lex_tag(size_t tag, char kind, char sign) {
    bool block = kind == '%';
    emit(block ? TokenType::kBlockBegin : TokenType::kVariableBegin, "", tag);
    size_t p = tag + 2 + (sign ? 1 : 0);
    std::vector<char> balance;
    while (true) {
      if (p >= src_.size()) {
        throw SyntaxError{
            p, std::string("unexpected end of template, expected '") + (block ? "%}" : "}}") + "'"};
      }
      if (balance.empty()) {
        size_t end_len = 0;
        if (block) {
          end_len = match_block_end(p);
        } else if (src_.substr(p, 3) == "-}}") {
          end_len = skip_space(p + 3) - p;
        } else if (src_.substr(p, 2) == "}}") {
          end_len = 2;
        }
        if (end_len != 0) {
          emit(block ? TokenType::kBlockEnd : TokenType::kVariableEnd, "", p);
          finish_tag(p + end_len);
          return;
        }
      }
      if (size_t n = space_at(p)) {
        p += n;
        continue;
      }
      char c = src_[p];
      if (is_digit(c)) {
        p = lex_number(p);
      } else if (is_name_start(c)) {
        size_t e = p;
        while (e < src_.size() && is_name_char(src_[e])) ++e;
        emit(TokenType::kName, std::string(src_.substr(p, e - p)), p);
        p = e;
      } else if (c == '\'' || c == '"') {
        size_t e = p + 1;
        while (e < src_.size() && src_[e] != c) e += src_[e] == '\\' ? 2 : 1;
        if (e >= src_.size()) throw SyntaxError{p, std::string("unexpected char '") + c + "'"};
        emit(TokenType::kString, unescape(src_.substr(p + 1, e - p - 1), p), p);
        p = e + 1;
      } else {
        p = lex_operator(p, balance);
      }
    }
  }

  size_t lex_number(size_t p) {
    auto digits = [&](size_t q) {  // digits with single underscores between them
      while (q < src_.size() && (is_digit(src_[q]) || (src_[q] == '_' && q + 1 < src_.size() &&
                                                       is_digit(src_[q + 1])))) {
        ++q;
      }
      return q;
    };
    auto strip_underscores = [](std::string_view s) {
      std::string r;
      for (char ch : s) {
        if (ch != '_') r += ch;
      }
      return r;
    };
    size_t e = p;
    bool after_dot = p > 0 && src_[p - 1] == '.';  // "messages.0.x": integers only
    if (src_[p] == '0' && p + 1 < src_.size() &&
        std::string_view("xXoObB").find(src_[p + 1]) != std::string_view::npos) {
      int base = (src_[p + 1] == 'x' || src_[p + 1] == 'X')   ? 16
                 : (src_[p + 1] == 'o' || src_[p + 1] == 'O') ? 8
                                                              : 2;
      e = p + 2;
      while (e < src_.size() && (hex_value(src_[e]) >= 0 || src_[e] == '_')) ++e;
      std::string body = strip_underscores(src_.substr(p + 2, e - p - 2));
      Token t{TokenType::kInteger, std::string(src_.substr(p, e - p))};
      auto r = std::from_chars(body.data(), body.data() + body.size(), t.int_value, base);
      if (body.empty() || r.ec != std::errc() || r.ptr != body.data() + body.size()) {
        throw SyntaxError{p, "invalid integer literal"};
      }
      t.offset = p;
      out_.push_back(std::move(t));
      return e;
    }
    e = digits(p);
    bool is_float = false;
    if (!after_dot && e + 1 < src_.size() && src_[e] == '.' && is_digit(src_[e + 1])) {
      e = digits(e + 1);
      is_float = true;
    }
    if (!after_dot && e < src_.size() && (src_[e] == 'e' || src_[e] == 'E')) {
      size_t q = e + 1;
      if (q < src_.size() && (src_[q] == '+' || src_[q] == '-')) ++q;
      if (q < src_.size() && is_digit(src_[q])) {
        e = digits(q);
        is_float = true;
      }
    }
    std::string text = strip_underscores(src_.substr(p, e - p));
    Token t{is_float ? TokenType::kFloat : TokenType::kInteger, text};
    t.offset = p;
    if (is_float) {
      t.float_value = std::strtod(text.c_str(), nullptr);
    } else {
      auto r = std::from_chars(text.data(), text.data() + text.size(), t.int_value);
      if (r.ec != std::errc()) throw SyntaxError{p, "integer literal too large"};
    }
    out_.push_back(std::move(t));
    return e;
  }

  size_t lex_operator(size_t p, std::vector<char>& balance) {
    static constexpr std::string_view kTwo[] = {"//", "**", "==", "!=", ">=", "<="};
    for (std::string_view op : kTwo) {
      if (src_.substr(p, 2) == op) {
        emit(TokenType::kOperator, std::string(op), p);
        return p + 2;
      }
    }
    char c = src_[p];
    if (std::string_view("+-/*%~[](){}><=.:|,;").find(c) == std::string_view::npos) {
      std::string shown = c == '\n' ? "\\n" : std::string(1, c);
      throw SyntaxError{p, "unexpected char '" + shown + "'"};
    }
    if (c == '(' || c == '[' || c == '{') {
      balance.push_back(c == '(' ? ')' : c == '[' ? ']' : '}');
    } else if (c == ')' || c == ']' || c == '}') {
      if (balance.empty()) throw SyntaxError{p, std::string("unexpected '") + c + "'"};
      if (balance.back() != c) {
        throw SyntaxError{p,
                          std::string("unexpected '") + c + "', expected '" + balance.back() + "'"};
      }
      balance.pop_back();
    }
    emit(TokenType::kOperator, std::string(1, c), p);
    return p + 1;
  }

  void emit(TokenType type, std::string value, size_t offset) {
    Token t;
    t.type = type;
    t.value = std::move(value);
    t.offset = offset;
    out_.push_back(std::move(t));
  }

  std::string_view src_;
  size_t pos_ = 0;
  bool line_starting_ = true;  // the last tag ended a line (or nothing came yet)
  std::vector<Token> out_;
};

}  // namespace

std::string normalize_source(std::string_view source) {
  std::string out;
  out.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      out += '\n';
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      out += source[i];
    }
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

std::vector<Token> tokenize(std::string_view source) { return Lexer(source).run(); }

std::pair<int, int> line_column(std::string_view source, size_t offset) {
  if (offset > source.size()) offset = source.size();
  int line = 1;
  size_t line_start = 0;
  for (size_t i = 0; i < offset; ++i) {
    if (source[i] == '\n') {
      ++line;
      line_start = i + 1;
    }
  }
  return {line, static_cast<int>(py::length(source.substr(line_start, offset - line_start))) + 1};
}

}  // namespace tessera::chat::jinja
