// Added tokens of tokenizer.json ("added_tokens"): special and ordinary tokens matched in the
// text before the model sees it, as Hugging Face tokenizers' AddedVocabulary does.
//
// Matching is leftmost-longest over all contents. Tokens with normalized=false are matched in
// the raw text first; the text between them is normalized and then searched for the tokens with
// normalized=true (whose contents are normalized too). Flags: single_word (the match must not
// touch word characters on either side), lstrip / rstrip (the match swallows the whitespace on
// its left / right), special (skipped by decode(skip_special_tokens)).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "common/tokenizer/regex.h"

namespace tessera::tokenizer {

class Normalizer;

struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = true;
  bool special = false;
};

// A part of a text: a matched added token (id >= 0) or plain text (id == -1), [begin, end) in
// bytes of the text that was searched.
struct Segment {
  size_t begin;
  size_t end;
  int32_t id;
};

class AddedVocabulary {
 public:
  AddedVocabulary() = default;
  // Adds `tokens` (in file order; their `id` is ignored) the way Hugging Face's add_tokens does:
  // a token whose content is already an added token or in the model's vocab
  // (`model_token_to_id`) gets that id, any other the next free id, counting from
  // `model_vocab_size`. Empty contents are ignored. `normalizer` (may be null) gives the
  // matching form of tokens with normalized=true.
  AddedVocabulary(std::vector<AddedToken> tokens,
                  const std::function<std::optional<int32_t>(std::string_view)>& model_token_to_id,
                  size_t model_vocab_size, const Normalizer* normalizer);

  // Splits `text` into segments covering it, in order, matching the tokens with
  // normalized == `normalized_tokens`. Thread-safe.
  std::vector<Segment> split(std::string_view text, bool normalized_tokens) const;

  // Lookups by content and by id.
  std::optional<int32_t> token_to_id(std::string_view content) const;
  const AddedToken* find(int32_t id) const;
  // The string decoding uses for `id`: the normalized content of normalized tokens, else the
  // content. Precondition: find(id) != nullptr.
  const std::string& decode_form(int32_t id) const;
  // True if `token` is the content of a special added token (decode(skip_special_tokens) drops
  // every token whose string is, as Hugging Face does).
  bool is_special_content(std::string_view token) const;
  // The added tokens, one per id, in id order.
  const std::vector<AddedToken>& tokens() const { return tokens_; }

 private:
  // A byte trie over the contents of one set of tokens.
  struct Trie {
    struct Node {
      std::vector<std::pair<uint8_t, int32_t>> children;  // sorted by byte
      int32_t token = -1;                                 // index into tokens_
    };
    std::vector<Node> nodes{Node{}};
    bool first_byte[256] = {};
    void insert(std::string_view key, int32_t token);
    // Longest key starting at text[pos]: (token index, length), token -1 if none.
    std::pair<int32_t, size_t> longest(std::string_view text, size_t pos) const;
  };

  // Whether `cp` is a word character (Rust's Unicode \w), for single_word.
  bool is_word_char(uint32_t cp) const;

  std::vector<AddedToken> tokens_;
  std::vector<std::string> match_forms_;  // per token: its content, normalized if normalized
  std::unordered_map<int32_t, size_t> by_id_;
  std::unordered_map<std::string, int32_t> by_content_;
  std::vector<std::string> special_contents_;  // sorted
  std::optional<Regex> word_char_;             // only when a token is single_word
  Trie raw_trie_;
  Trie normalized_trie_;
};

}  // namespace tessera::tokenizer
