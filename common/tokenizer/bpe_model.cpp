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

// The SAX events of tokenizer.json: every value goes to nlohmann's document builder except
// model.vocab and model.merges of the BPE shapes, which go to the tables. A value of the wrong
// type inside them stops the parse with `error` naming it.
class TokenizerSax {
 public:
  explicit TokenizerSax(json& doc, BpeTables& tables) : dom_(doc, true), t_(tables) {}

  bool null() {
    return value([] { return json(nullptr); }, [&] { return dom_.null(); });
  }
  bool boolean(bool v) {
    return value([&] { return json(v); }, [&] { return dom_.boolean(v); });
  }
  bool number_integer(json::number_integer_t v) {
    if (mode_ == Mode::kVocab) return vocab_id(v);
    return value([&] { return json(v); }, [&] { return dom_.number_integer(v); });
  }
  bool number_unsigned(json::number_unsigned_t v) {
    if (mode_ == Mode::kVocab) {
      return v <= static_cast<uint64_t>(INT64_MAX) ? vocab_id(static_cast<int64_t>(v))
                                                   : bad_id(json(v).dump());
    }
    return value([&] { return json(v); }, [&] { return dom_.number_unsigned(v); });
  }
  bool number_float(json::number_float_t v, const json::string_t& s) {
    return value([&] { return json(v); }, [&] { return dom_.number_float(v, s); });
  }
  bool string(json::string_t& v) {
    if (mode_ == Mode::kMerges) {
      t_.merges.push_back({t_.add(v), {}, true});
      return true;
    }
    if (mode_ == Mode::kPair) {
      if (pair_size_ == 2) return bad_merge();
      pair_[pair_size_++] = t_.add(v);
      return true;
    }
    return value([&] { return json(v); }, [&] { return dom_.string(v); });
  }
  bool binary(json::binary_t& v) { return dom_.binary(v); }
  bool start_object(std::size_t n) {
    if (mode_ == Mode::kVocab) return bad_id("an object");
    if (mode_ != Mode::kDom) return bad_merge();
    if (at_model_key("vocab")) {
      mode_ = Mode::kVocab;
      t_.vocab_streamed = true;
      t_.vocab.clear();
      return true;
    }
    frames_.push_back({});
    return dom_.start_object(n);
  }
  bool key(json::string_t& k) {
    if (mode_ == Mode::kVocab) {
      key_ = std::move(k);
      return true;
    }
    frames_.back().key = k;
    return dom_.key(k);
  }
  bool end_object() {
    if (mode_ == Mode::kVocab) {
      mode_ = Mode::kDom;
      return true;
    }
    frames_.pop_back();
    return dom_.end_object();
  }
  bool start_array(std::size_t n) {
    if (mode_ == Mode::kVocab) return bad_id("an array");
    if (mode_ == Mode::kMerges) {
      mode_ = Mode::kPair;
      pair_size_ = 0;
      return true;
    }
    if (mode_ == Mode::kPair) return bad_merge();
    if (at_model_key("merges")) {
      mode_ = Mode::kMerges;
      t_.merges_streamed = true;
      t_.merges.clear();
      return true;
    }
    frames_.push_back({"", false});
    return dom_.start_array(n);
  }
  bool end_array() {
    if (mode_ == Mode::kPair) {
      if (pair_size_ != 2) return bad_merge();
      t_.merges.push_back({pair_[0], pair_[1], false});
      mode_ = Mode::kMerges;
      return true;
    }
    if (mode_ == Mode::kMerges) {
      mode_ = Mode::kDom;
      return true;
    }
    frames_.pop_back();
    return dom_.end_array();
  }
  template <class Exception>
  bool parse_error(std::size_t at, const std::string& token, const Exception& e) {
    return dom_.parse_error(at, token, e);  // throws e, as json::parse does
  }

  const std::string& error() const { return error_; }

 private:
  enum class Mode : uint8_t { kDom, kVocab, kMerges, kPair };
  struct Frame {
    std::string key;  // the key whose value comes next (objects)
    bool object = true;
  };

  // Whether the container starting now is the value of `key` in the root's "model" object.
  bool at_model_key(const char* key) const {
    return frames_.size() == 2 && frames_[0].object && frames_[0].key == "model" &&
           frames_[1].object && frames_[1].key == key;
  }
  // A scalar: to the document, or (inside the vocab or merges) an error; `got` makes the value
  // only for the error's text, so the document's values are not copied on the way.
  template <class Got, class Dom>
  bool value(Got got, Dom dom) {
    if (mode_ == Mode::kVocab) return bad_id(got().dump());
    if (mode_ != Mode::kDom) return bad_merge();
    return dom();
  }
  bool vocab_id(int64_t id) {
    if (id < 0 || id > INT32_MAX - 1) return bad_id(std::to_string(id));
    t_.vocab.emplace_back(t_.add(key_), static_cast<int32_t>(id));
    return true;
  }
  bool bad_id(const std::string& got) {
    error_ = "the id of vocab token '" + key_ + "' must be an integer in [0, " +
             std::to_string(INT32_MAX - 1) + "], got " + got;
    return false;
  }
  bool bad_merge() {
    error_ = "merge " + std::to_string(t_.merges.size() + 1) + " is not a pair";
    return false;
  }

  nlohmann::detail::json_sax_dom_parser<json> dom_;
  BpeTables& t_;
  std::vector<Frame> frames_;
  Mode mode_ = Mode::kDom;
  std::string key_;
  BpeTables::Slice pair_[2];
  int pair_size_ = 0;
  std::string error_;
};

// The document's vocab and merges (model.vocab / model.merges that were not streamed) into the
// tables' form. Throws json::exception on a wrong structure, as the document's accessors do.
Status tables_from_document(const json& spec, BpeTables& t) {
  if (!t.vocab_streamed) {
    const json& vocab = spec.at("vocab");
    t.vocab.reserve(vocab.size());
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      TESSERA_ASSIGN_OR_RETURN(
          int64_t id,
          json_integer(it.value(), 0, INT32_MAX - 1, "the id of vocab token '" + it.key() + "'"));
      t.vocab.emplace_back(t.add(it.key()), static_cast<int32_t>(id));
    }
  }
  if (!t.merges_streamed) {
    for (const json& merge : spec.at("merges")) {
      if (merge.is_string()) {
        t.merges.push_back({t.add(merge.get_ref<const std::string&>()), {}, true});
      } else if (merge.is_array() && merge.size() == 2) {
        const BpeTables::Slice a = t.add(merge[0].get<std::string>());
        t.merges.push_back({a, t.add(merge[1].get<std::string>()), false});
      } else {
        return invalid_argument("merge " + std::to_string(t.merges.size() + 1) + " is not a pair");
      }
    }
  }
  return Status::ok();
}

}  // namespace

void BpeModel::MergeTable::reserve(size_t n) {
  size_t slots = 16;
  while (slots < 2 * n) slots *= 2;
  if (slots <= slots_.size()) return;
  std::vector<Slot> old = std::move(slots_);
  slots_.assign(slots, Slot{});
  used_ = 0;
  for (const Slot& s : old) {
    if (s.used) insert_or_assign(s.key, s.merge);
  }
}

size_t BpeModel::MergeTable::home(uint64_t key) const {
  key ^= key >> 33;  // a 64-bit finalizer (MurmurHash3's): pair keys differ in few bits
  key *= 0xff51afd7ed558ccdULL;
  key ^= key >> 33;
  return static_cast<size_t>(key) & (slots_.size() - 1);
}

void BpeModel::MergeTable::insert_or_assign(uint64_t key, Merge m) {
  if (2 * (used_ + 1) > slots_.size()) reserve(std::max<size_t>(2 * used_, 8));
  for (size_t i = home(key);; i = (i + 1) & (slots_.size() - 1)) {
    Slot& s = slots_[i];
    if (!s.used) {
      s = Slot{key, m, true};
      ++used_;
      return;
    }
    if (s.key == key) {
      s.merge = m;
      return;
    }
  }
}

const BpeModel::Merge* BpeModel::MergeTable::find(uint64_t key) const {
  if (slots_.empty()) return nullptr;
  for (size_t i = home(key);; i = (i + 1) & (slots_.size() - 1)) {
    const Slot& s = slots_[i];
    if (!s.used) return nullptr;  // at most half full: an empty slot ends every probe
    if (s.key == key) return &s.merge;
  }
}

Expected<json> parse_tokenizer_json(std::string_view text, std::string_view origin,
                                    BpeTables& tables) {
  json doc;
  tables.arena.reserve(text.size());  // its tokens are unescaped pieces of the text: no regrowth
  try {
    TokenizerSax sax(doc, tables);
    if (!json::sax_parse(text, &sax)) {
      return invalid_argument(std::string(origin) + ": " + sax.error());
    }
  } catch (const json::exception& e) {  // parse_error, or out_of_range for 1e999
    return invalid_argument(std::string(origin) + ": malformed JSON: " + e.what());
  }
  return doc;
}

Expected<std::unique_ptr<BpeModel>> BpeModel::from_json(const json& spec, BpeTables tables) {
  std::string type = spec.value("type", std::string("BPE"));
  if (type != "BPE") {
    return invalid_argument("model type '" + type + "' is not supported (supported: BPE)");
  }
  if (spec.contains("dropout") && !spec["dropout"].is_null() &&
      spec["dropout"].get<double>() != 0.0) {
    return invalid_argument("BPE dropout is not supported");
  }
  TESSERA_RETURN_IF_ERROR(tables_from_document(spec, tables));
  std::unique_ptr<BpeModel> model(new BpeModel());
  model->vocab_.reserve(tables.vocab.size());
  int32_t max_id = -1;
  const std::string* max_token = nullptr;
  for (const auto& [token, id] : tables.vocab) {
    auto [it, added] = model->vocab_.insert_or_assign(std::string(tables.view(token)), id);
    if (id > max_id) {
      max_id = id;
      max_token = &it->first;
    }
  }
  // Ids index tables (id -> token, id -> bytes): a vocabulary's ids are 0..n-1, give or take
  // gaps. One id far past the rest would make those tables gigabytes (found by the fuzzer).
  constexpr int64_t kMaxIdGap = 1 << 20;
  const size_t size = model->vocab_.size();
  if (max_id >= static_cast<int64_t>(size) + kMaxIdGap) {
    return invalid_argument("vocab token '" + *max_token + "' has id " + std::to_string(max_id) +
                            ", but the vocabulary has " + std::to_string(size) +
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

  model->merges_.reserve(tables.merges.size());
  const size_t prefix_len = model->continuing_subword_prefix_.size();
  uint32_t rank = 0;
  std::string merged;
  for (const BpeTables::Merge& merge : tables.merges) {
    std::string_view a = tables.view(merge.first), b = tables.view(merge.second);
    if (merge.line) {
      const std::string_view line = a;
      if (line.starts_with("#version")) continue;
      const size_t space = line.find(' ');
      if (space == std::string_view::npos || line.find(' ', space + 1) != std::string_view::npos) {
        return invalid_argument("merge " + std::to_string(rank + 1) + " ('" + std::string(line) +
                                "') is not two tokens separated by one space");
      }
      a = line.substr(0, space);
      b = line.substr(space + 1);
    }
    auto a_id = model->token_to_id(a);
    auto b_id = model->token_to_id(b);
    if (!a_id || !b_id) {
      return invalid_argument("merge '" + std::string(a) + " " + std::string(b) + "' uses token '" +
                              std::string(a_id ? b : a) + "' that is not in the vocab");
    }
    merged.assign(a).append(b.substr(std::min(prefix_len, b.size())));
    auto new_id = model->token_to_id(merged);
    if (!new_id) {
      return invalid_argument("merge '" + std::string(a) + " " + std::string(b) + "' makes '" +
                              merged + "' that is not in the vocab");
    }
    model->merges_.insert_or_assign(pair_key(*a_id, *b_id), Merge{rank, *new_id});
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
  auto find = [&](int32_t a, int32_t b) { return merges_.find(pair_key(a, b)); };
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
