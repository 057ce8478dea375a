// A Hugging Face tokenizer.json tokenizer, run exactly as the `tokenizers` library runs it.
//
// Pipeline of encode(): added tokens are matched first (leftmost-longest; special and ordinary,
// with their single_word / lstrip / rstrip / normalized flags), the text between them is
// normalized, pre-tokenized and tokenized by the BPE model, and the post-processor adds the
// special tokens. decode() maps ids to token strings (dropping special tokens if asked) and runs
// the decoder chain. What is supported is what Llama 2/3, Mistral and Qwen 2/3 use:
//   model          BPE (merges as strings or pairs, byte_fallback, fuse_unk, ignore_merges)
//   normalizer     NFC, Prepend, Replace, Sequence
//   pre_tokenizer  Split (PCRE2 regex), ByteLevel, Metaspace, Sequence
//   post_processor TemplateProcessing, ByteLevel, Sequence
//   decoder        ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace, Sequence
// Anything else fails to load with an error naming the file and the unsupported type. The
// "truncation" and "padding" sections are ignored (callers truncate explicitly).
//
// Thread safety: a loaded Tokenizer is immutable; every const method may be called from many
// threads at once (the BPE cache inside is locked).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "common/tokenizer/tokenizer_config.h"

namespace tessera {

namespace tokenizer {
class AddedVocabulary;
class BpeModel;
class Decoder;
class Normalizer;
class PostProcessor;
class PreTokenizer;
}  // namespace tokenizer

class Tokenizer {
 public:
  // Loads <dir>/tokenizer.json and, when present, <dir>/tokenizer_config.json,
  // <dir>/generation_config.json and <dir>/chat_template.jinja (used when tokenizer_config.json
  // has no chat_template). NOT_FOUND "<dir>/tokenizer.json: no such file" when it is missing;
  // INVALID_ARGUMENT naming the file for malformed JSON, an unsupported component
  // ("<dir>/tokenizer.json: model type 'Unigram' is not supported (supported: BPE)") or a bad
  // field.
  static Expected<std::unique_ptr<Tokenizer>> load(const std::string& dir);

  // Builds a tokenizer from the texts of tokenizer.json and (optionally, empty for none)
  // tokenizer_config.json; `origin` and `config_origin` name them in error messages. Without a
  // config this is the `tokenizers` library's Tokenizer.from_file; with one, transformers'
  // AutoTokenizer: the config's tokenizer class, legacy and add_prefix_space change the pipeline
  // as transformers 5 does (tokenizer.cpp lists the rules).
  static Expected<std::unique_ptr<Tokenizer>> from_json(
      std::string_view tokenizer_json, std::string_view config_json = {},
      std::string_view origin = "tokenizer.json",
      std::string_view config_origin = "tokenizer_config.json");

  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // Token ids of `text`. With add_special_tokens the post-processor adds its tokens (e.g. <s>);
  // special-token text inside `text` ("<|im_start|>") is always matched as that token.
  // Ill-formed UTF-8 in `text` is first replaced by U+FFFD.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens) const;

  // Text of `ids`. Ids that are not in the vocab are skipped; with skip_special_tokens every
  // token whose string is a special added token is too. Incomplete or invalid UTF-8 byte
  // sequences become U+FFFD, as in Hugging Face.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens) const;

  // Number of distinct tokens, added tokens included (Hugging Face's len(tokenizer)); for the
  // supported tokenizers the ids are exactly 0 .. vocab_size() - 1.
  size_t vocab_size() const { return vocab_size_; }
  // Id of a token string (added tokens first, then the model's vocab), as stored (byte-level
  // tokens in their GPT-2 alphabet form, e.g. "Ġthe").
  std::optional<int32_t> token_to_id(std::string_view token) const;
  // The token string of `id`, or nullopt.
  std::optional<std::string> id_to_token(int32_t id) const;
  // True if decode(skip_special_tokens = true) drops `id`.
  bool is_special(int32_t id) const;

  // The bos token's id (tokenizer_config.json's bos_token), or nullopt (Qwen has none).
  std::optional<int32_t> bos_id() const { return bos_id_; }
  // Ids that end generation: tokenizer_config.json's eos_token, then generation_config.json's
  // eos_token_id list; no duplicates.
  const std::vector<int32_t>& eos_ids() const { return eos_ids_; }
  // Whether encode(text, true) starts with the bos token: tokenizer_config.json's add_bos_token
  // if given, else whether the post-processor adds a leading special token.
  bool add_bos_token() const { return add_bos_token_; }
  // The chat template (Jinja source), empty if there is none.
  const std::string& chat_template() const { return config_.chat_template; }
  // Context length from tokenizer_config.json, nullopt if absent or unlimited.
  std::optional<int64_t> model_max_length() const { return config_.model_max_length; }
  const TokenizerConfig& config() const { return config_; }

 private:
  Tokenizer();
  // Finishes loading: the fields derived from the components and the config (again after
  // load() merges generation_config.json).
  void derive_settings();
  // The per-id decode tables (byte-level bytes, special or not), derived from the components
  // only: once per tokenizer. After derive_settings (it uses vocab_size_).
  void derive_id_tables();

  std::unique_ptr<tokenizer::Normalizer> normalizer_;         // may be null
  std::unique_ptr<tokenizer::PreTokenizer> pre_tokenizer_;    // may be null
  std::unique_ptr<tokenizer::BpeModel> model_;                // never null
  std::unique_ptr<tokenizer::PostProcessor> post_processor_;  // may be null
  std::unique_ptr<tokenizer::Decoder> decoder_;               // may be null
  std::unique_ptr<tokenizer::AddedVocabulary> added_;         // never null
  TokenizerConfig config_;
  size_t vocab_size_ = 0;
  std::optional<int32_t> bos_id_;
  std::vector<int32_t> eos_ids_;
  bool add_bos_token_ = false;
  // With a ByteLevel decoder alone (Llama 3, Qwen): each id's decoded bytes and whether it is
  // special, so that decode (detokenization runs once per generated token) concatenates instead
  // of copying token strings through the decoder. Empty otherwise.
  std::vector<std::string> id_bytes_;
  std::vector<uint8_t> id_special_;
};

}  // namespace tessera
