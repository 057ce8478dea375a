// tokenizer_config.json (and generation_config.json): the settings around a tokenizer that
// Hugging Face transformers reads — special tokens, add_bos_token, the chat template, the
// context length.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"

namespace tessera {

struct TokenizerConfig {
  // Special tokens by content; a token given as an object ({"content": ...}) is read by its
  // content. nullopt when absent or null.
  std::optional<std::string> bos_token;
  std::optional<std::string> eos_token;
  std::optional<std::string> pad_token;
  std::optional<std::string> unk_token;
  // As written; encode follows tokenizer.json's post-processor, as transformers 5 does.
  std::optional<bool> add_bos_token;
  std::optional<bool> add_eos_token;
  // transformers' class ("LlamaTokenizerFast", ...), empty when absent; with `legacy` and
  // `add_prefix_space` it changes the pipeline as transformers 5 does (see tokenizer.cpp).
  std::string tokenizer_class;
  std::optional<bool> legacy;
  std::optional<bool> add_prefix_space;
  // The default chat template (Jinja source); empty when there is none. A config that lists
  // named templates gives the one named "default" here and all of them in named_chat_templates.
  std::string chat_template;
  std::vector<std::pair<std::string, std::string>> named_chat_templates;
  // Context length; nullopt when absent or "unlimited" (transformers writes 1e30 for that).
  std::optional<int64_t> model_max_length;
  bool clean_up_tokenization_spaces = false;
  // From generation_config.json: ids that also end generation (Llama 3 instruct lists
  // <|eot_id|> there), and its bos id.
  std::vector<int32_t> generation_eos_ids;
  std::optional<int32_t> generation_bos_id;
};

// Parses the text of a tokenizer_config.json; `origin` (its path) prefixes error messages.
// INVALID_ARGUMENT for malformed JSON or a field of the wrong type.
Expected<TokenizerConfig> parse_tokenizer_config(std::string_view json_text,
                                                 std::string_view origin);

// Reads eos_token_id (a number or a list) and bos_token_id of a generation_config.json's text
// into `config`. INVALID_ARGUMENT for malformed JSON.
Status merge_generation_config(std::string_view json_text, std::string_view origin,
                               TokenizerConfig& config);

}  // namespace tessera
