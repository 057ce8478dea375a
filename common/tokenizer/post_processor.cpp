#include "common/tokenizer/post_processor.h"

#include <nlohmann/json.hpp>

#include <string>

namespace tessera::tokenizer {
namespace {

using nlohmann::json;

// TemplateProcessing's "single" template: special-token ids and the sequence ("A"), in order.
class TemplateProcessor final : public PostProcessor {
 public:
  struct Piece {
    bool is_sequence;
    std::vector<int32_t> ids;  // of a special token
  };
  explicit TemplateProcessor(std::vector<Piece> pieces) : pieces_(std::move(pieces)) {}

  void process(std::vector<int32_t>& ids, bool add_special_tokens) const override {
    if (!add_special_tokens) return;
    std::vector<int32_t> out;
    out.reserve(ids.size() + 4);
    for (const Piece& piece : pieces_) {
      const auto& part = piece.is_sequence ? ids : piece.ids;
      out.insert(out.end(), part.begin(), part.end());
    }
    ids = std::move(out);
  }

  std::optional<int32_t> leading_special() const override {
    if (pieces_.empty() || pieces_[0].is_sequence || pieces_[0].ids.empty()) return std::nullopt;
    return pieces_[0].ids[0];
  }

 private:
  std::vector<Piece> pieces_;
};

class NoOpProcessor final : public PostProcessor {
 public:
  void process(std::vector<int32_t>&, bool) const override {}
};

class SequenceProcessor final : public PostProcessor {
 public:
  explicit SequenceProcessor(std::vector<std::unique_ptr<PostProcessor>> steps)
      : steps_(std::move(steps)) {}
  void process(std::vector<int32_t>& ids, bool add_special_tokens) const override {
    for (const auto& step : steps_) step->process(ids, add_special_tokens);
  }
  std::optional<int32_t> leading_special() const override {
    for (const auto& step : steps_) {
      if (auto id = step->leading_special()) return id;
    }
    return std::nullopt;
  }

 private:
  std::vector<std::unique_ptr<PostProcessor>> steps_;
};

Expected<std::unique_ptr<PostProcessor>> make_template(const json& spec) {
  const json& specials = spec.at("special_tokens");
  std::vector<TemplateProcessor::Piece> pieces;
  for (const json& piece : spec.at("single")) {
    if (piece.contains("Sequence")) {
      pieces.push_back({true, {}});
      continue;
    }
    std::string name = piece.at("SpecialToken").at("id").get<std::string>();
    if (!specials.contains(name)) {
      return invalid_argument("TemplateProcessing names special token '" + name +
                              "' that is not in its special_tokens");
    }
    pieces.push_back({false, specials.at(name).at("ids").get<std::vector<int32_t>>()});
  }
  return std::unique_ptr<PostProcessor>(std::make_unique<TemplateProcessor>(std::move(pieces)));
}

}  // namespace

Expected<std::unique_ptr<PostProcessor>> make_post_processor(const json& spec) {
  if (spec.is_null()) return std::unique_ptr<PostProcessor>();
  std::string type = spec.at("type").get<std::string>();
  if (type == "TemplateProcessing") return make_template(spec);
  if (type == "ByteLevel") return std::unique_ptr<PostProcessor>(std::make_unique<NoOpProcessor>());
  if (type == "Sequence") {
    std::vector<std::unique_ptr<PostProcessor>> steps;
    for (const json& step : spec.at("processors")) {
      TESSERA_ASSIGN_OR_RETURN(auto processor, make_post_processor(step));
      if (processor) steps.push_back(std::move(processor));
    }
    return std::unique_ptr<PostProcessor>(std::make_unique<SequenceProcessor>(std::move(steps)));
  }
  return invalid_argument("post_processor type '" + type +
                          "' is not supported (supported: TemplateProcessing, ByteLevel, "
                          "Sequence)");
}

}  // namespace tessera::tokenizer
