#include "common/tokenizer/decoder.h"

#include <nlohmann/json.hpp>

#include "common/tokenizer/json_file.h"
#include "common/tokenizer/regex.h"
#include "common/tokenizer/unicode.h"

namespace tessera::tokenizer {
namespace {

using nlohmann::json;

}  // namespace

std::string byte_level_bytes(std::string_view token) {
  std::string bytes;
  bytes.reserve(token.size());
  for (size_t pos = 0; pos < token.size();) {
    const int byte = unicode_to_byte(next_code_point(token, pos));
    if (byte < 0) return std::string(token);
    bytes.push_back(static_cast<char>(byte));
  }
  return bytes;
}

namespace {

class ByteLevelDecoder final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::string bytes;
    for (const std::string& token : tokens) bytes += byte_level_bytes(token);
    tokens.assign(1, utf8_lossy(bytes));
  }
  bool byte_level() const override { return true; }
};

class ReplaceDecoder final : public Decoder {
 public:
  ReplaceDecoder(std::string literal, std::optional<Regex> regex, std::string content)
      : literal_(std::move(literal)), regex_(std::move(regex)), content_(std::move(content)) {}

  void decode_chain(std::vector<std::string>& tokens) const override {
    for (std::string& token : tokens) {
      if (regex_) {
        std::string out;
        size_t pos = 0;
        for (auto [begin, end] : regex_->find_all(token)) {
          out.append(token, pos, begin - pos).append(content_);
          pos = end;
        }
        token = out.append(token, pos);
        continue;
      }
      if (literal_.empty() || token.find(literal_) == std::string::npos) continue;
      std::string out;
      size_t pos = 0;
      for (size_t hit; (hit = token.find(literal_, pos)) != std::string::npos;
           pos = hit + literal_.size()) {
        out.append(token, pos, hit - pos).append(content_);
      }
      token = out.append(token, pos);
    }
  }

 private:
  std::string literal_;
  std::optional<Regex> regex_;  // set when the pattern is a regex
  std::string content_;
};

class ByteFallbackDecoder final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::vector<std::string> out;
    out.reserve(tokens.size());
    std::string pending;  // bytes of consecutive <0xAB> tokens
    size_t pending_count = 0;
    auto flush = [&] {
      if (pending_count == 0) return;
      if (is_valid_utf8(pending)) {
        out.push_back(pending);
      } else {
        for (size_t i = 0; i < pending_count; ++i) out.emplace_back("\xEF\xBF\xBD");
      }
      pending.clear();
      pending_count = 0;
    };
    for (std::string& token : tokens) {
      int byte = parse_byte_token(token);
      if (byte >= 0) {
        pending.push_back(static_cast<char>(byte));
        ++pending_count;
        continue;
      }
      flush();
      out.push_back(std::move(token));
    }
    flush();
    tokens = std::move(out);
  }

 private:
  // The byte of a "<0xAB>" token, or -1.
  static int parse_byte_token(const std::string& token) {
    if (token.size() != 6 || token.compare(0, 3, "<0x") != 0 || token[5] != '>') return -1;
    auto hex = [](char c) {
      if (c >= '0' && c <= '9') return c - '0';
      if (c >= 'a' && c <= 'f') return c - 'a' + 10;
      if (c >= 'A' && c <= 'F') return c - 'A' + 10;
      return -1;
    };
    int hi = hex(token[3]), lo = hex(token[4]);
    return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
  }
};

class FuseDecoder final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::string joined;
    for (const std::string& token : tokens) joined += token;
    tokens.assign(1, std::move(joined));
  }
};

// Removes up to `start` leading and `stop` trailing copies of one character from each token.
class StripDecoder final : public Decoder {
 public:
  StripDecoder(uint32_t content, size_t start, size_t stop)
      : content_(content), start_(start), stop_(stop) {}

  void decode_chain(std::vector<std::string>& tokens) const override {
    for (std::string& token : tokens) {
      std::vector<size_t> starts;  // byte offset of each char
      for (size_t pos = 0; pos < token.size();) {
        starts.push_back(pos);
        next_code_point(token, pos);
      }
      auto char_at = [&](size_t i) {
        size_t pos = starts[i];
        return next_code_point(token, pos);
      };
      size_t begin = 0;
      for (size_t i = 0; i < start_ && i < starts.size() && char_at(i) == content_; ++i) begin++;
      size_t end = starts.size();
      for (size_t i = 0; i < stop_ && end > begin && char_at(end - 1) == content_; ++i) end--;
      size_t byte_begin = begin < starts.size() ? starts[begin] : token.size();
      size_t byte_end = end < starts.size() ? starts[end] : token.size();
      token = token.substr(byte_begin, byte_end - byte_begin);
    }
  }

 private:
  uint32_t content_;
  size_t start_;
  size_t stop_;
};

// The replacement char becomes a space, except at the start of the first token when the
// pre-tokenizer prepends it.
class MetaspaceDecoder final : public Decoder {
 public:
  MetaspaceDecoder(std::string replacement, bool strip_first)
      : replacement_(std::move(replacement)), strip_first_(strip_first) {}

  void decode_chain(std::vector<std::string>& tokens) const override {
    for (size_t i = 0; i < tokens.size(); ++i) {
      std::string out;
      const std::string& token = tokens[i];
      for (size_t pos = 0; pos < token.size();) {
        if (token.compare(pos, replacement_.size(), replacement_) == 0) {
          if (!(i == 0 && strip_first_)) out.push_back(' ');
          pos += replacement_.size();
        } else {
          out.push_back(token[pos++]);
        }
      }
      tokens[i] = std::move(out);
    }
  }

 private:
  std::string replacement_;
  bool strip_first_;
};

class SequenceDecoder final : public Decoder {
 public:
  explicit SequenceDecoder(std::vector<std::unique_ptr<Decoder>> steps)
      : steps_(std::move(steps)) {}
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (const auto& step : steps_) step->decode_chain(tokens);
  }

 private:
  std::vector<std::unique_ptr<Decoder>> steps_;
};

Expected<std::unique_ptr<Decoder>> make_replace(const json& spec) {
  const json& pattern = spec.at("pattern");
  std::string content = spec.at("content").get<std::string>();
  if (pattern.contains("String")) {
    return std::unique_ptr<Decoder>(std::make_unique<ReplaceDecoder>(
        pattern.at("String").get<std::string>(), std::nullopt, std::move(content)));
  }
  TESSERA_ASSIGN_OR_RETURN(Regex regex, Regex::compile(pattern.at("Regex").get<std::string>()));
  return std::unique_ptr<Decoder>(
      std::make_unique<ReplaceDecoder>("", std::move(regex), std::move(content)));
}

Expected<std::unique_ptr<Decoder>> make_strip(const json& spec) {
  std::string content = spec.at("content").get<std::string>();
  size_t pos = 0;
  if (content.empty()) return invalid_argument("Strip decoder with an empty content");
  uint32_t cp = next_code_point(content, pos);
  if (pos != content.size()) return invalid_argument("Strip decoder content is not one char");
  TESSERA_ASSIGN_OR_RETURN(int64_t start,
                           json_integer(spec.at("start"), 0, 1 << 20, "Strip decoder start"));
  TESSERA_ASSIGN_OR_RETURN(int64_t stop,
                           json_integer(spec.at("stop"), 0, 1 << 20, "Strip decoder stop"));
  return std::unique_ptr<Decoder>(
      std::make_unique<StripDecoder>(cp, static_cast<size_t>(start), static_cast<size_t>(stop)));
}

}  // namespace

Expected<std::unique_ptr<Decoder>> make_decoder(const json& spec) {
  if (spec.is_null()) return std::unique_ptr<Decoder>();
  std::string type = spec.at("type").get<std::string>();
  if (type == "ByteLevel") return std::unique_ptr<Decoder>(std::make_unique<ByteLevelDecoder>());
  if (type == "Replace") return make_replace(spec);
  if (type == "ByteFallback") {
    return std::unique_ptr<Decoder>(std::make_unique<ByteFallbackDecoder>());
  }
  if (type == "Fuse") return std::unique_ptr<Decoder>(std::make_unique<FuseDecoder>());
  if (type == "Strip") return make_strip(spec);
  if (type == "Metaspace") {
    std::string scheme = spec.value("prepend_scheme", std::string("always"));
    bool strip_first = scheme != "never";
    if (spec.contains("add_prefix_space") && spec["add_prefix_space"].is_boolean() &&
        !spec["add_prefix_space"].get<bool>()) {
      strip_first = false;
    }
    return std::unique_ptr<Decoder>(
        std::make_unique<MetaspaceDecoder>(spec.at("replacement").get<std::string>(), strip_first));
  }
  if (type == "Sequence") {
    std::vector<std::unique_ptr<Decoder>> steps;
    for (const json& step : spec.at("decoders")) {
      TESSERA_ASSIGN_OR_RETURN(auto decoder, make_decoder(step));
      if (decoder) steps.push_back(std::move(decoder));
    }
    return std::unique_ptr<Decoder>(std::make_unique<SequenceDecoder>(std::move(steps)));
  }
  return invalid_argument("decoder type '" + type +
                          "' is not supported (supported: ByteLevel, Replace, ByteFallback, "
                          "Fuse, Strip, Metaspace, Sequence)");
}

}  // namespace tessera::tokenizer
