// The BPE model of tokenizer.json ("model": {"type": "BPE", ...}): turns one pre-token into
// token ids by applying merges in rank order, as Hugging Face tokenizers' BPE does.
//
// Supports vocab + merges (as "a b" strings or [a, b] pairs), unk_token with fuse_unk,
// byte_fallback (<0xAB> tokens for characters not in the vocab), ignore_merges (a pre-token
// found whole in the vocab is one token), continuing_subword_prefix and end_of_word_suffix.
// Dropout is not supported (a non-zero dropout fails to load).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "common/status.h"

namespace tessera::tokenizer {

// Hash for unordered maps keyed by std::string that accept std::string_view lookups.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using TokenMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

class BpeModel {
 public:
  // Builds the model from `spec` (the "model" value of tokenizer.json). INVALID_ARGUMENT when
  // the type is not "BPE" ("model type 'Unigram' is not supported (supported: BPE)"), a merge
  // names a token outside the vocab, or an option is unsupported. May throw
  // nlohmann::json::exception on a malformed structure.
  static Expected<std::unique_ptr<BpeModel>> from_json(const nlohmann::json& spec);

  // Appends the ids of `word` (one pre-token) to `out`. Thread-safe: results of words shorter
  // than kMaxCachedLength bytes are cached, the cache is shared and locked.
  void tokenize(std::string_view word, std::vector<int32_t>& out) const;

  std::optional<int32_t> token_to_id(std::string_view token) const;
  // The token of `id`, or null if the vocab has no such id.
  const std::string* id_to_token(int32_t id) const;
  // Number of entries of the vocab.
  size_t vocab_size() const { return vocab_.size(); }
  // Largest id of the vocab (-1 if empty).
  int32_t max_id() const { return static_cast<int32_t>(id_to_token_.size()) - 1; }

  static constexpr size_t kMaxCachedLength = 256;
  static constexpr size_t kCacheCapacity = 10000;

 private:
  BpeModel() = default;
  // Ids before caching: characters (with byte fallback / unk) merged by rank.
  void merge_word(std::string_view word, std::vector<int32_t>& out) const;

  struct Merge {
    uint32_t rank;
    int32_t new_id;
  };
  static uint64_t pair_key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }

  TokenMap vocab_;
  std::vector<const std::string*> id_to_token_;  // points into vocab_'s keys; null for gaps
  std::unordered_map<uint64_t, Merge> merges_;
  std::optional<int32_t> unk_id_;
  bool fuse_unk_ = false;
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;
  std::string continuing_subword_prefix_;
  std::string end_of_word_suffix_;
  std::vector<int32_t> byte_ids_;  // id of <0xAB> for each byte, -1 if absent

  mutable std::shared_mutex cache_mu_;
  // Guarded by cache_mu_. Emptied when it reaches kCacheCapacity entries.
  mutable std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> cache_;
};

}  // namespace tessera::tokenizer
