#include "common/tokenizer/pre_tokenizer.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <optional>

#include "common/tokenizer/regex.h"
#include "common/tokenizer/unicode.h"

namespace tessera::tokenizer {
namespace {

using nlohmann::json;

// GPT-2's pattern, what ByteLevel splits with when use_regex is true.
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

Expected<Behavior> parse_behavior(const std::string& name) {
  if (name == "Removed") return Behavior::kRemoved;
  if (name == "Isolated") return Behavior::kIsolated;
  if (name == "MergedWithPrevious") return Behavior::kMergedWithPrevious;
  if (name == "MergedWithNext") return Behavior::kMergedWithNext;
  if (name == "Contiguous") return Behavior::kContiguous;
  return invalid_argument("Split behavior '" + name + "' is not supported");
}

struct Span {
  size_t begin;
  size_t end;
  bool flag;  // is_match before the fold, remove after it
};

// Splits `piece` the way NormalizedString::split does: the matches of `regex` (flags inverted
// if `invert`) folded according to `behavior`; appends the non-empty, non-removed parts.
void split_piece(const PreToken& piece, const Regex& regex, Behavior behavior, bool invert,
                 std::vector<PreToken>& out) {
  const std::string& text = piece.text;
  if (text.empty()) return;
  std::vector<Span> matches;
  size_t prev = 0;
  for (auto [begin, end] : regex.find_all(text)) {
    if (prev != begin) matches.push_back({prev, begin, invert});
    matches.push_back({begin, end, !invert});
    prev = end;
  }
  if (prev != text.size()) matches.push_back({prev, text.size(), invert});

  std::vector<Span> splits;
  bool previous_match = false;
  switch (behavior) {
    case Behavior::kIsolated:
      for (const Span& m : matches) splits.push_back({m.begin, m.end, false});
      break;
    case Behavior::kRemoved:
      splits = matches;
      break;
    case Behavior::kContiguous:
      for (const Span& m : matches) {
        if (m.flag == previous_match && !splits.empty()) {
          splits.back().end = m.end;
        } else {
          splits.push_back({m.begin, m.end, false});
        }
        previous_match = m.flag;
      }
      break;
    case Behavior::kMergedWithPrevious:
      for (const Span& m : matches) {
        if (m.flag && !previous_match && !splits.empty()) {
          splits.back().end = m.end;
        } else {
          splits.push_back({m.begin, m.end, false});
        }
        previous_match = m.flag;
      }
      break;
    case Behavior::kMergedWithNext:
      for (auto it = matches.rbegin(); it != matches.rend(); ++it) {
        if (it->flag && !previous_match && !splits.empty()) {
          splits.back().begin = it->begin;
        } else {
          splits.push_back({it->begin, it->end, false});
        }
        previous_match = it->flag;
      }
      std::reverse(splits.begin(), splits.end());
      break;
  }
  for (const Span& s : splits) {
    if (s.flag || s.end == s.begin) continue;
    out.push_back({text.substr(s.begin, s.end - s.begin), piece.at_start && s.begin == 0});
  }
}

class SplitPreTokenizer final : public PreTokenizer {
 public:
  SplitPreTokenizer(Regex regex, Behavior behavior, bool invert)
      : regex_(std::move(regex)), behavior_(behavior), invert_(invert) {}

  void pre_tokenize(std::vector<PreToken>& pieces) const override {
    std::vector<PreToken> out;
    out.reserve(pieces.size() * 4);
    for (const PreToken& piece : pieces) split_piece(piece, regex_, behavior_, invert_, out);
    pieces = std::move(out);
  }

 private:
  Regex regex_;
  Behavior behavior_;
  bool invert_;
};

class ByteLevelPreTokenizer final : public PreTokenizer {
 public:
  ByteLevelPreTokenizer(bool add_prefix_space, std::optional<Regex> regex)
      : add_prefix_space_(add_prefix_space), regex_(std::move(regex)) {}

  void pre_tokenize(std::vector<PreToken>& pieces) const override {
    if (add_prefix_space_) {
      for (PreToken& piece : pieces) {
        if (!piece.text.empty() && piece.text[0] != ' ') piece.text.insert(0, " ");
      }
    }
    if (regex_) {
      std::vector<PreToken> out;
      for (const PreToken& piece : pieces) {
        split_piece(piece, *regex_, Behavior::kIsolated, false, out);
      }
      pieces = std::move(out);
    }
    for (PreToken& piece : pieces) {
      std::string mapped;
      append_byte_level(piece.text, mapped);
      piece.text = std::move(mapped);
    }
  }

 private:
  bool add_prefix_space_;
  std::optional<Regex> regex_;
};

class MetaspacePreTokenizer final : public PreTokenizer {
 public:
  enum class Prepend { kAlways, kFirst, kNever };

  MetaspacePreTokenizer(std::string replacement, Prepend prepend, bool split, Regex regex)
      : replacement_(std::move(replacement)),
        prepend_(prepend),
        split_(split),
        regex_(std::move(regex)) {}

  void pre_tokenize(std::vector<PreToken>& pieces) const override {
    std::vector<PreToken> out;
    for (PreToken& piece : pieces) {
      std::string text;
      for (char c : piece.text) {
        if (c == ' ') {
          text += replacement_;
        } else {
          text.push_back(c);
        }
      }
      bool starts = text.compare(0, replacement_.size(), replacement_) == 0;
      if (!text.empty() && !starts &&
          (prepend_ == Prepend::kAlways || (prepend_ == Prepend::kFirst && piece.at_start))) {
        text.insert(0, replacement_);
      }
      PreToken replaced{std::move(text), piece.at_start};
      if (split_) {
        split_piece(replaced, regex_, Behavior::kMergedWithNext, false, out);
      } else if (!replaced.text.empty()) {
        out.push_back(std::move(replaced));
      }
    }
    pieces = std::move(out);
  }

 private:
  std::string replacement_;
  Prepend prepend_;
  bool split_;
  Regex regex_;  // matches the replacement
};

class SequencePreTokenizer final : public PreTokenizer {
 public:
  explicit SequencePreTokenizer(std::vector<std::unique_ptr<PreTokenizer>> steps)
      : steps_(std::move(steps)) {}
  void pre_tokenize(std::vector<PreToken>& pieces) const override {
    for (const auto& step : steps_) step->pre_tokenize(pieces);
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> steps_;
};

Expected<std::unique_ptr<PreTokenizer>> make_metaspace(const json& spec) {
  std::string replacement = spec.at("replacement").get<std::string>();
  std::string scheme = spec.value("prepend_scheme", std::string("always"));
  MetaspacePreTokenizer::Prepend prepend;
  if (scheme == "always") {
    prepend = MetaspacePreTokenizer::Prepend::kAlways;
  } else if (scheme == "first") {
    prepend = MetaspacePreTokenizer::Prepend::kFirst;
  } else if (scheme == "never") {
    prepend = MetaspacePreTokenizer::Prepend::kNever;
  } else {
    return invalid_argument("Metaspace prepend_scheme '" + scheme + "' is not supported");
  }
  // Legacy files say add_prefix_space instead of prepend_scheme.
  if (spec.contains("add_prefix_space") && spec["add_prefix_space"].is_boolean() &&
      !spec["add_prefix_space"].get<bool>()) {
    prepend = MetaspacePreTokenizer::Prepend::kNever;
  }
  bool split = spec.value("split", true);
  TESSERA_ASSIGN_OR_RETURN(Regex regex, Regex::literal(replacement));
  return std::unique_ptr<PreTokenizer>(std::make_unique<MetaspacePreTokenizer>(
      std::move(replacement), prepend, split, std::move(regex)));
}

}  // namespace

void append_byte_level(std::string_view bytes, std::string& out) {
  out.reserve(out.size() + bytes.size() * 2);
  for (char c : bytes) out.append(byte_to_unicode(static_cast<uint8_t>(c)));
}

Expected<std::unique_ptr<PreTokenizer>> make_pre_tokenizer(const json& spec) {
  if (spec.is_null()) return std::unique_ptr<PreTokenizer>();
  std::string type = spec.at("type").get<std::string>();
  if (type == "Split") {
    const json& pattern = spec.at("pattern");
    Expected<Regex> regex = pattern.contains("String")
                                ? Regex::literal(pattern.at("String").get<std::string>())
                                : Regex::compile(pattern.at("Regex").get<std::string>());
    if (!regex) return regex.status().with_context("pre_tokenizer Split");
    TESSERA_ASSIGN_OR_RETURN(Behavior behavior,
                             parse_behavior(spec.at("behavior").get<std::string>()));
    return std::unique_ptr<PreTokenizer>(std::make_unique<SplitPreTokenizer>(
        std::move(regex).value(), behavior, spec.value("invert", false)));
  }
  if (type == "ByteLevel") {
    std::optional<Regex> regex;
    if (spec.value("use_regex", true)) {
      TESSERA_ASSIGN_OR_RETURN(Regex gpt2, Regex::compile(kGpt2Pattern));
      regex = std::move(gpt2);
    }
    return std::unique_ptr<PreTokenizer>(std::make_unique<ByteLevelPreTokenizer>(
        spec.value("add_prefix_space", true), std::move(regex)));
  }
  if (type == "Metaspace") return make_metaspace(spec);
  if (type == "Sequence") {
    std::vector<std::unique_ptr<PreTokenizer>> steps;
    for (const json& step : spec.at("pretokenizers")) {
      TESSERA_ASSIGN_OR_RETURN(auto pre_tokenizer, make_pre_tokenizer(step));
      if (pre_tokenizer) steps.push_back(std::move(pre_tokenizer));
    }
    return std::unique_ptr<PreTokenizer>(std::make_unique<SequencePreTokenizer>(std::move(steps)));
  }
  return invalid_argument("pre_tokenizer type '" + type +
                          "' is not supported (supported: Split, ByteLevel, Metaspace, Sequence)");
}

}  // namespace tessera::tokenizer
