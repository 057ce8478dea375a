#include "common/tokenizer/normalizer.h"

#include <nlohmann/json.hpp>

#include <vector>

#include "common/tokenizer/regex.h"
#include "common/tokenizer/unicode.h"

namespace tessera::tokenizer {
namespace {

using nlohmann::json;

class NfcNormalizer final : public Normalizer {
 public:
  void normalize(std::string& text) const override {
    if (!is_nfc_quick(text)) text = nfc(text);
  }
};

// Prepends a string to non-empty text.
class PrependNormalizer final : public Normalizer {
 public:
  explicit PrependNormalizer(std::string prefix) : prefix_(std::move(prefix)) {}
  void normalize(std::string& text) const override {
    if (!text.empty()) text.insert(0, prefix_);
  }

 private:
  std::string prefix_;
};

// Replaces every match of a pattern (a literal string or a regex) with `content`.
class ReplaceNormalizer final : public Normalizer {
 public:
  ReplaceNormalizer(std::string literal, Regex regex, std::string content)
      : literal_(std::move(literal)), regex_(std::move(regex)), content_(std::move(content)) {}

  void normalize(std::string& text) const override {
    if (!literal_.empty()) {  // plain substring replacement: the common, fast case
      if (text.find(literal_) == std::string::npos) return;
      std::string out;
      out.reserve(text.size() + text.size() / 2);
      size_t pos = 0;
      for (size_t hit; (hit = text.find(literal_, pos)) != std::string::npos;
           pos = hit + literal_.size()) {
        out.append(text, pos, hit - pos).append(content_);
      }
      out.append(text, pos);
      text = std::move(out);
      return;
    }
    auto matches = regex_.find_all(text);
    if (matches.empty()) return;
    std::string out;
    size_t pos = 0;
    for (auto [begin, end] : matches) {
      out.append(text, pos, begin - pos).append(content_);
      pos = end;
    }
    out.append(text, pos);
    text = std::move(out);
  }

 private:
  std::string literal_;  // empty when the pattern is a regex
  Regex regex_;
  std::string content_;
};

class SequenceNormalizer final : public Normalizer {
 public:
  explicit SequenceNormalizer(std::vector<std::unique_ptr<Normalizer>> steps)
      : steps_(std::move(steps)) {}
  void normalize(std::string& text) const override {
    for (const auto& step : steps_) step->normalize(text);
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> steps_;
};

}  // namespace

Expected<std::unique_ptr<Normalizer>> make_normalizer(const json& spec) {
  if (spec.is_null()) return std::unique_ptr<Normalizer>();
  std::string type = spec.at("type").get<std::string>();
  if (type == "NFC") return std::unique_ptr<Normalizer>(std::make_unique<NfcNormalizer>());
  if (type == "Prepend") {
    return std::unique_ptr<Normalizer>(
        std::make_unique<PrependNormalizer>(spec.at("prepend").get<std::string>()));
  }
  if (type == "Replace") {
    const json& pattern = spec.at("pattern");
    std::string content = spec.at("content").get<std::string>();
    if (pattern.contains("String")) {
      std::string literal = pattern.at("String").get<std::string>();
      TESSERA_ASSIGN_OR_RETURN(Regex regex, Regex::literal(literal));
      if (literal.empty()) return std::unique_ptr<Normalizer>();  // matches nothing
      return std::unique_ptr<Normalizer>(
          std::make_unique<ReplaceNormalizer>(literal, std::move(regex), content));
    }
    TESSERA_ASSIGN_OR_RETURN(Regex regex, Regex::compile(pattern.at("Regex").get<std::string>()));
    return std::unique_ptr<Normalizer>(
        std::make_unique<ReplaceNormalizer>("", std::move(regex), content));
  }
  if (type == "Sequence") {
    std::vector<std::unique_ptr<Normalizer>> steps;
    for (const json& step : spec.at("normalizers")) {
      TESSERA_ASSIGN_OR_RETURN(auto normalizer, make_normalizer(step));
      if (normalizer) steps.push_back(std::move(normalizer));
    }
    return std::unique_ptr<Normalizer>(std::make_unique<SequenceNormalizer>(std::move(steps)));
  }
  return invalid_argument("normalizer type '" + type +
                          "' is not supported (supported: NFC, Prepend, Replace, Sequence)");
}

}  // namespace tessera::tokenizer
