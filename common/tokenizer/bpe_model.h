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

// A BPE model's vocab and merges in file order, as parse_tokenizer_json streams them past the
// JSON document: a 128k-token vocabulary and its ~280k merges were most of a load's time when
// built as document nodes (a std::map entry per token) only to be copied into the model's maps.
struct BpeTables {
  // Every token and merge text lives in one arena, each entry a slice of it: one growing
  // buffer instead of a string (and under ASan an allocation) per entry.
  struct Slice {
    size_t begin = 0;
    size_t size = 0;
  };
  struct Merge {
    Slice first;   // the whole "a b" line when line is true
    Slice second;  // empty for a line
    bool line = false;
  };
  bool vocab_streamed = false;   // false: read model.vocab from the document
  bool merges_streamed = false;  // false: read model.merges from the document
  std::string arena;
  std::vector<std::pair<Slice, int32_t>> vocab;  // (token, id)
  std::vector<Merge> merges;

  Slice add(std::string_view text) {
    Slice s{arena.size(), text.size()};
    arena.append(text);
    return s;
  }
  std::string_view view(Slice s) const { return std::string_view(arena).substr(s.begin, s.size); }
};

// Parses tokenizer.json into a document without model.vocab / model.merges where they have the
// BPE shapes (an object of token -> id; an array of "a b" lines or [a, b] pairs): those go to
// `tables` (the document keeps a null in their place). INVALID_ARGUMENT "<origin>: malformed
// JSON: ..." on a syntax error, or "<origin>: ..." naming the vocab token or merge whose value
// has the wrong type.
Expected<nlohmann::json> parse_tokenizer_json(std::string_view text, std::string_view origin,
                                              BpeTables& tables);

class BpeModel {
 public:
  // Builds the model from `spec` (the "model" value of tokenizer.json), with its vocab and
  // merges from `tables` where parse_tokenizer_json streamed them there. INVALID_ARGUMENT when
  // the type is not "BPE" ("model type 'Unigram' is not supported (supported: BPE)"), a merge
  // names a token outside the vocab, or an option is unsupported. May throw
  // nlohmann::json::exception on a malformed structure.
  static Expected<std::unique_ptr<BpeModel>> from_json(const nlohmann::json& spec,
                                                       BpeTables tables = {});

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

  // The merges by pair_key: open addressing with linear probing in a power-of-two table at
  // most half full. One allocation for all of them, where a node-based map made one per merge
  // (~280k for a 128k vocabulary: most of a load under ASan, and scattered reads in encode).
  class MergeTable {
   public:
    void reserve(size_t n);
    void insert_or_assign(uint64_t key, Merge m);  // a later merge of the same pair wins
    const Merge* find(uint64_t key) const;

   private:
    struct Slot {
      uint64_t key = 0;
      Merge merge{};
      bool used = false;
    };
    size_t home(uint64_t key) const;
    std::vector<Slot> slots_;
    size_t used_ = 0;
  };

  TokenMap vocab_;
  std::vector<const std::string*> id_to_token_;  // points into vocab_'s keys; null for gaps
  MergeTable merges_;
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
