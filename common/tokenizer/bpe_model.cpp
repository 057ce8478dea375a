#include "common/tokenizer/bpe_model.h"

#include <nlohmann/json.hpp>

#include <cstdio>
#include <mutex>
#include <queue>

#include "common/tokenizer/json_file.h"

namespace tessera::tokenizer {
namespace {

using nlohmann::json;

// Length of the UTF-8 sequence that starts with byte `b` (1 for stray bytes, which the caller
// never sees: pre-tokens are well-formed).
size_t utf8_length(unsigned char b) {
  if (b < 0xC0) return 1;
  if (b < 0xE0) return 2;
  if (b < 0xF0) return 3;
  return 4;
}

struct Symbol {
  int32_t id;
  int32_t prev;
  int32_t next;
  bool alive;
};

struct QueuedMerge {
  uint32_t rank;
  int32_t pos;
  int32_t new_id;
  // std::priority_queue pops the largest: make the lowest rank, then the leftmost, the largest.
  bool operator<(const QueuedMerge& o) const {
    return rank != o.rank ? rank > o.rank : pos > o.pos;
  }
};

}  // namespace

Expected<std::unique_ptr<BpeModel>> BpeModel::from_json(const json& spec) {
  std::string type = spec.value("type", std::string("BPE"));
  if (type != "BPE") {
    return invalid_argument("model type '" + type + "' is not supported (supported: BPE)");
  }
  if (spec.contains("dropout") && !spec["dropout"].is_null() &&
      spec["dropout"].get<double>() != 0.0) {
    return invalid_argument("BPE dropout is not supported");
  }
  std::unique_ptr<BpeModel> model(new BpeModel());
  const json& vocab = spec.at("vocab");
  model->vocab_.reserve(vocab.size());
  int32_t max_id = -1;
  std::string max_token;
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    TESSERA_ASSIGN_OR_RETURN(
        int64_t id64,
        json_integer(it.value(), 0, INT32_MAX - 1, "the id of vocab token '" + it.key() + "'"));
    const auto id = static_cast<int32_t>(id64);
    model->vocab_[it.key()] = id;
    if (id > max_id) {
      max_id = id;
      max_token = it.key();
    }
  }
  // Ids index tables (id -> token, id -> bytes): a vocabulary's ids are 0..n-1, give or take
  // gaps. One id far past the rest would make those tables gigabytes (found by the fuzzer).
  constexpr int64_t kMaxIdGap = 1 << 20;
  if (max_id >= static_cast<int64_t>(vocab.size()) + kMaxIdGap) {
    return invalid_argument("vocab token '" + max_token + "' has id " + std::to_string(max_id) +
                            ", but the vocabulary has " + std::to_string(vocab.size()) +
                            " tokens: ids must be below its size plus " +
                            std::to_string(kMaxIdGap) + " (a corrupt tokenizer.json?)");
  }
  model->id_to_token_.assign(static_cast<size_t>(max_id + 1), nullptr);
  for (const auto& [token, id] : model->vocab_) model->id_to_token_[id] = &token;

  auto optional_string = [&](const char* key) {
    return spec.contains(key) && spec[key].is_string() ? spec[key].get<std::string>()
                                                       : std::string();
  };
  model->continuing_subword_prefix_ = optional_string("continuing_subword_prefix");
  model->end_of_word_suffix_ = optional_string("end_of_word_suffix");
  model->fuse_unk_ = spec.value("fuse_unk", false);
  model->byte_fallback_ = spec.value("byte_fallback", false);
  model->ignore_merges_ = spec.value("ignore_merges", false);
  if (std::string unk = optional_string("unk_token"); !unk.empty()) {
    model->unk_id_ = model->token_to_id(unk);
  }
  model->byte_ids_.assign(256, -1);
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    if (auto id = model->token_to_id(name)) model->byte_ids_[b] = *id;
  }

  const json& merges = spec.at("merges");
  model->merges_.reserve(merges.size());
  const size_t prefix_len = model->continuing_subword_prefix_.size();
  uint32_t rank = 0;
  std::string merged;
  for (const json& merge : merges) {
    std::string a, b;
    if (merge.is_string()) {
      const std::string& line = merge.get_ref<const std::string&>();
      if (line.rfind("#version", 0) == 0) continue;
      size_t space = line.find(' ');
      if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos) {
        return invalid_argument("merge " + std::to_string(rank + 1) + " ('" + line +
                                "') is not two tokens separated by one space");
      }
      a = line.substr(0, space);
      b = line.substr(space + 1);
    } else {
      if (!merge.is_array() || merge.size() != 2) {
        return invalid_argument("merge " + std::to_string(rank + 1) + " is not a pair");
      }
      a = merge[0].get<std::string>();
      b = merge[1].get<std::string>();
    }
    auto a_id = model->token_to_id(a);
    auto b_id = model->token_to_id(b);
    if (!a_id || !b_id) {
      return invalid_argument("merge '" + a + " " + b + "' uses token '" + (a_id ? b : a) +
                              "' that is not in the vocab");
    }
    merged.assign(a).append(b, std::min(prefix_len, b.size()));
    auto new_id = model->token_to_id(merged);
    if (!new_id) {
      return invalid_argument("merge '" + a + " " + b + "' makes '" + merged +
                              "' that is not in the vocab");
    }
    model->merges_[pair_key(*a_id, *b_id)] = Merge{rank, *new_id};
    ++rank;
  }
  return model;
}

std::optional<int32_t> BpeModel::token_to_id(std::string_view token) const {
  auto it = vocab_.find(token);
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

const std::string* BpeModel::id_to_token(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= id_to_token_.size()) return nullptr;
  return id_to_token_[id];
}

void BpeModel::tokenize(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    if (auto it = vocab_.find(word); it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  bool cacheable = word.size() < kMaxCachedLength;
  if (cacheable) {
    std::shared_lock lock(cache_mu_);
    if (auto it = cache_.find(word); it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  size_t first = out.size();
  merge_word(word, out);
  if (cacheable) {
    std::vector<int32_t> ids(out.begin() + static_cast<ptrdiff_t>(first), out.end());
    std::unique_lock lock(cache_mu_);
    if (cache_.size() >= kCacheCapacity) cache_.clear();
    cache_.emplace(std::string(word), std::move(ids));
  }
}

void BpeModel::merge_word(std::string_view word, std::vector<int32_t>& out) const {
  std::vector<Symbol> symbols;
  symbols.reserve(word.size());
  auto add = [&](int32_t id) {
    int32_t index = static_cast<int32_t>(symbols.size());
    symbols.push_back({id, index - 1, -1, true});
    if (index > 0) symbols[index - 1].next = index;
  };
  std::optional<int32_t> pending_unk;  // an unk waiting to be fused with the next ones
  std::string key;
  for (size_t pos = 0; pos < word.size();) {
    size_t len = std::min(utf8_length(static_cast<unsigned char>(word[pos])), word.size() - pos);
    bool is_first = pos == 0;
    bool is_last = pos + len == word.size();
    key.clear();
    if (!is_first) key += continuing_subword_prefix_;
    key.append(word.substr(pos, len));
    if (is_last) key += end_of_word_suffix_;
    pos += len;

    if (auto it = vocab_.find(key); it != vocab_.end()) {
      if (pending_unk) add(*pending_unk);
      pending_unk.reset();
      add(it->second);
      continue;
    }
    if (byte_fallback_) {
      bool all = true;
      for (char c : key) all = all && byte_ids_[static_cast<uint8_t>(c)] >= 0;
      if (all) {
        for (char c : key) add(byte_ids_[static_cast<uint8_t>(c)]);
        continue;
      }
    }
    if (unk_id_) {
      if (pending_unk && !fuse_unk_) add(*pending_unk);
      pending_unk = unk_id_;
    }
  }
  if (pending_unk) add(*pending_unk);

  std::priority_queue<QueuedMerge> queue;
  auto find = [&](int32_t a, int32_t b) -> const Merge* {
    auto it = merges_.find(pair_key(a, b));
    return it == merges_.end() ? nullptr : &it->second;
  };
  for (size_t i = 0; i + 1 < symbols.size(); ++i) {
    if (const Merge* m = find(symbols[i].id, symbols[i + 1].id)) {
      queue.push({m->rank, static_cast<int32_t>(i), m->new_id});
    }
  }
  while (!queue.empty()) {
    QueuedMerge top = queue.top();
    queue.pop();
    Symbol& left = symbols[top.pos];
    if (!left.alive || left.next < 0) continue;
    int32_t right_pos = left.next;
    Symbol& right = symbols[right_pos];
    const Merge* current = find(left.id, right.id);
    if (current == nullptr || current->new_id != top.new_id) continue;  // stale entry
    left.id = top.new_id;
    right.alive = false;
    left.next = right.next;
    if (left.next >= 0) symbols[left.next].prev = top.pos;
    if (left.prev >= 0) {
      if (const Merge* m = find(symbols[left.prev].id, left.id)) {
        queue.push({m->rank, left.prev, m->new_id});
      }
    }
    if (left.next >= 0) {
      if (const Merge* m = find(left.id, symbols[left.next].id)) {
        queue.push({m->rank, top.pos, m->new_id});
      }
    }
  }
  for (const Symbol& s : symbols) {
    if (s.alive) out.push_back(s.id);
  }
}

}  // namespace tessera::tokenizer
