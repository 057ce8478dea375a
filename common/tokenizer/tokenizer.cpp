#include "common/tokenizer/tokenizer.h"

#include <algorithm>
#include <filesystem>

#include "common/tokenizer/added_vocabulary.h"
#include "common/tokenizer/bpe_model.h"
#include "common/tokenizer/decoder.h"
#include "common/tokenizer/json_file.h"
#include "common/tokenizer/normalizer.h"
#include "common/tokenizer/post_processor.h"
#include "common/tokenizer/pre_tokenizer.h"
#include "common/tokenizer/unicode.h"

namespace tessera {

using nlohmann::json;
using tokenizer::AddedToken;
using tokenizer::AddedVocabulary;
using tokenizer::PreToken;
using tokenizer::Segment;

Tokenizer::Tokenizer() = default;
Tokenizer::~Tokenizer() = default;

namespace {

// Prompts must get the ids vLLM gets, and vLLM tokenizes with transformers' AutoTokenizer. Its
// version 5 keeps only the vocabulary and merges of tokenizer.json for the classes that define
// their own pipeline, and reads tokenizer_config.json for their options (measured against
// transformers 5.17 in tests/tokenizer/tokenizer_flags_test.cpp):
//  - LlamaTokenizer (and ...Fast): no normalizer, a Metaspace pre-tokenizer whose prepend scheme
//    is "always" for legacy, "first" otherwise (legacy defaults to false), "never" without
//    add_prefix_space (default true), and the decoder Replace, ByteFallback, Fuse (+ Strip one
//    leading space with the prefix). transformers does this to byte-level vocabularies too,
//    which breaks them; here it applies only to SentencePiece-style BPE (byte_fallback).
//  - Qwen2Tokenizer: its byte-level pre-tokenizer takes add_prefix_space (default false).
// add_bos_token and add_eos_token in the file change nothing there: tokenizer.json's
// post-processor decides which special tokens encode adds.
void apply_transformers_rules(const TokenizerConfig& config, json& spec) {
  std::string cls = config.tokenizer_class;
  if (cls.size() > 4 && cls.ends_with("Fast")) cls.resize(cls.size() - 4);
  json& model = spec["model"];
  if (cls == "LlamaTokenizer" && model.value("type", std::string()) == "BPE" &&
      model.value("byte_fallback", false)) {
    const bool prefix = config.add_prefix_space.value_or(true);
    const bool legacy = config.legacy.value_or(false);
    const std::string space = "\xe2\x96\x81";  // ▁
    spec["normalizer"] = nullptr;
    spec["pre_tokenizer"] = {{"type", "Metaspace"},
                             {"replacement", space},
                             {"prepend_scheme", prefix ? (legacy ? "always" : "first") : "never"},
                             {"split", false}};
    json decoders =
        json::array({{{"type", "Replace"}, {"pattern", {{"String", space}}}, {"content", " "}},
                     {{"type", "ByteFallback"}},
                     {{"type", "Fuse"}}});
    if (prefix)
      decoders.push_back({{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}});
    spec["decoder"] = {{"type", "Sequence"}, {"decoders", std::move(decoders)}};
    model["fuse_unk"] = true;
  }
  if (cls == "Qwen2Tokenizer") {
    const bool prefix = config.add_prefix_space.value_or(false);
    json& pre = spec["pre_tokenizer"];
    auto set_prefix = [&](json& p) {
      if (p.is_object() && p.value("type", std::string()) == "ByteLevel")
        p["add_prefix_space"] = prefix;
    };
    if (pre.is_object() && pre.value("type", std::string()) == "Sequence") {
      for (json& p : pre["pretokenizers"]) set_prefix(p);
    } else {
      set_prefix(pre);
    }
  }
}

}  // namespace

Expected<std::unique_ptr<Tokenizer>> Tokenizer::load(const std::string& dir) {
  namespace fs = std::filesystem;
  std::string tokenizer_path = (fs::path(dir) / "tokenizer.json").string();
  TESSERA_ASSIGN_OR_RETURN(std::string tokenizer_json, tokenizer::read_text_file(tokenizer_path));
  std::string config_path = (fs::path(dir) / "tokenizer_config.json").string();
  std::string config_json;
  if (std::error_code ec; fs::exists(config_path, ec)) {
    TESSERA_ASSIGN_OR_RETURN(config_json, tokenizer::read_text_file(config_path));
  }
  TESSERA_ASSIGN_OR_RETURN(auto tok,
                           from_json(tokenizer_json, config_json, tokenizer_path, config_path));
  std::string generation_path = (fs::path(dir) / "generation_config.json").string();
  if (std::error_code ec; fs::exists(generation_path, ec)) {
    TESSERA_ASSIGN_OR_RETURN(std::string text, tokenizer::read_text_file(generation_path));
    TESSERA_RETURN_IF_ERROR(merge_generation_config(text, generation_path, tok->config_));
  }
  std::string template_path = (fs::path(dir) / "chat_template.jinja").string();
  if (std::error_code ec; tok->config_.chat_template.empty() && fs::exists(template_path, ec)) {
    TESSERA_ASSIGN_OR_RETURN(tok->config_.chat_template, tokenizer::read_text_file(template_path));
  }
  tok->derive_settings();
  return tok;
}

Expected<std::unique_ptr<Tokenizer>> Tokenizer::from_json(std::string_view tokenizer_json,
                                                          std::string_view config_json,
                                                          std::string_view origin,
                                                          std::string_view config_origin) {
  std::string where(origin);
  tokenizer::BpeTables tables;
  TESSERA_ASSIGN_OR_RETURN(json spec,
                           tokenizer::parse_tokenizer_json(tokenizer_json, origin, tables));
  if (!spec.is_object()) return invalid_argument(where + ": not a JSON object");
  std::unique_ptr<Tokenizer> tok(new Tokenizer());
  if (!config_json.empty()) {
    TESSERA_ASSIGN_OR_RETURN(tok->config_, parse_tokenizer_config(config_json, config_origin));
  }
  auto located = [&](const Status& status) { return status.with_context(where); };
  try {
    apply_transformers_rules(tok->config_, spec);
    if (spec.contains("version") && spec["version"] != "1.0") {
      return invalid_argument(where + ": unknown tokenizer version " + spec["version"].dump());
    }
    if (!spec.contains("model")) return invalid_argument(where + ": has no \"model\"");
    auto model = tokenizer::BpeModel::from_json(spec["model"], std::move(tables));
    if (!model) return located(model.status());
    tok->model_ = std::move(model).value();

    static const json kNull;
    auto section = [&](const char* key) -> const json& {
      return spec.contains(key) ? spec[key] : kNull;
    };
    auto normalizer = tokenizer::make_normalizer(section("normalizer"));
    if (!normalizer) return located(normalizer.status());
    tok->normalizer_ = std::move(normalizer).value();
    auto pre_tokenizer = tokenizer::make_pre_tokenizer(section("pre_tokenizer"));
    if (!pre_tokenizer) return located(pre_tokenizer.status());
    tok->pre_tokenizer_ = std::move(pre_tokenizer).value();
    auto post_processor = tokenizer::make_post_processor(section("post_processor"));
    if (!post_processor) return located(post_processor.status());
    tok->post_processor_ = std::move(post_processor).value();
    auto decoder = tokenizer::make_decoder(section("decoder"));
    if (!decoder) return located(decoder.status());
    tok->decoder_ = std::move(decoder).value();

    std::vector<AddedToken> added;
    for (const json& entry : section("added_tokens")) {
      AddedToken token;
      token.content = entry.at("content").get<std::string>();
      token.single_word = entry.value("single_word", false);
      token.lstrip = entry.value("lstrip", false);
      token.rstrip = entry.value("rstrip", false);
      token.special = entry.value("special", false);
      token.normalized = entry.value("normalized", !token.special);
      added.push_back(std::move(token));
    }
    const tokenizer::BpeModel& bpe = *tok->model_;
    tok->added_ = std::make_unique<AddedVocabulary>(
        std::move(added), [&bpe](std::string_view s) { return bpe.token_to_id(s); },
        bpe.vocab_size(), tok->normalizer_.get());
  } catch (const json::exception& e) {
    return invalid_argument(where + ": unexpected structure: " + e.what());
  }
  tok->derive_settings();
  tok->derive_id_tables();
  return tok;
}

void Tokenizer::derive_settings() {
  vocab_size_ = model_->vocab_size();
  for (const AddedToken& token : added_->tokens()) {
    if (!model_->token_to_id(token.content)) ++vocab_size_;
  }
  bos_id_.reset();
  if (config_.bos_token) bos_id_ = token_to_id(*config_.bos_token);
  eos_ids_.clear();
  auto add_eos = [&](int32_t id) {
    if (std::find(eos_ids_.begin(), eos_ids_.end(), id) == eos_ids_.end()) eos_ids_.push_back(id);
  };
  if (config_.eos_token) {
    if (auto id = token_to_id(*config_.eos_token)) add_eos(*id);
  }
  for (int32_t id : config_.generation_eos_ids) add_eos(id);
  if (config_.add_bos_token) {
    add_bos_token_ = *config_.add_bos_token;
  } else {
    add_bos_token_ = post_processor_ && post_processor_->leading_special().has_value();
  }
}

void Tokenizer::derive_id_tables() {
  id_bytes_.clear();
  id_special_.clear();
  if (decoder_ && decoder_->byte_level()) {
    size_t ids = vocab_size_;
    for (const AddedToken& token : added_->tokens()) {
      ids = std::max(ids, static_cast<size_t>(std::max(token.id, 0)) + 1);
    }
    id_bytes_.resize(ids);
    id_special_.assign(ids, 0);
    for (size_t id = 0; id < ids; ++id) {
      const int32_t i = static_cast<int32_t>(id);
      const std::string* token =
          added_->find(i) != nullptr ? &added_->decode_form(i) : model_->id_to_token(i);
      if (token == nullptr) continue;  // no such id: decodes to nothing, as below
      id_bytes_[id] = tokenizer::byte_level_bytes(*token);
      id_special_[id] = added_->is_special_content(*token) ? 1 : 0;
    }
  }
}

std::vector<int32_t> Tokenizer::encode(std::string_view input, bool add_special_tokens) const {
  std::string repaired;
  std::string_view text = input;
  if (!tokenizer::is_valid_utf8(input)) {
    repaired = tokenizer::utf8_lossy(input);
    text = repaired;
  }
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  std::vector<PreToken> pieces;
  for (const Segment& segment : added_->split(text, /*normalized_tokens=*/false)) {
    if (segment.id >= 0) {
      ids.push_back(segment.id);
      continue;
    }
    std::string normalized(text.substr(segment.begin, segment.end - segment.begin));
    if (normalized.empty()) continue;
    if (normalizer_) normalizer_->normalize(normalized);
    for (const Segment& sub : added_->split(normalized, /*normalized_tokens=*/true)) {
      if (sub.id >= 0) {
        ids.push_back(sub.id);
        continue;
      }
      if (sub.end == sub.begin) continue;
      pieces.clear();
      pieces.push_back({normalized.substr(sub.begin, sub.end - sub.begin),
                        segment.begin == 0 && sub.begin == 0});
      if (pre_tokenizer_) pre_tokenizer_->pre_tokenize(pieces);
      for (const PreToken& piece : pieces) model_->tokenize(piece.text, ids);
    }
  }
  if (post_processor_) post_processor_->process(ids, add_special_tokens);
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  if (!id_bytes_.empty()) {
    std::string bytes;
    for (int32_t id : ids) {
      if (id < 0 || static_cast<size_t>(id) >= id_bytes_.size()) continue;
      if (skip_special_tokens && id_special_[static_cast<size_t>(id)] != 0) continue;
      bytes += id_bytes_[static_cast<size_t>(id)];
    }
    return tokenizer::utf8_lossy(bytes);
  }
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    const std::string* token =
        added_->find(id) != nullptr ? &added_->decode_form(id) : model_->id_to_token(id);
    if (token == nullptr) continue;
    if (skip_special_tokens && added_->is_special_content(*token)) continue;
    tokens.push_back(*token);
  }
  std::string text;
  if (decoder_) {
    decoder_->decode_chain(tokens);
    for (const std::string& part : tokens) text += part;
  } else {
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (i > 0) text.push_back(' ');
      text += tokens[i];
    }
  }
  return text;
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  if (auto id = added_->token_to_id(token)) return id;
  return model_->token_to_id(token);
}

std::optional<std::string> Tokenizer::id_to_token(int32_t id) const {
  if (const AddedToken* token = added_->find(id)) return token->content;
  if (const std::string* token = model_->id_to_token(id)) return *token;
  return std::nullopt;
}

bool Tokenizer::is_special(int32_t id) const {
  const std::string* token =
      added_->find(id) != nullptr ? &added_->decode_form(id) : model_->id_to_token(id);
  return token != nullptr && added_->is_special_content(*token);
}

}  // namespace tessera
