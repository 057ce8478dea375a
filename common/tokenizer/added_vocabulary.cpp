#include "common/tokenizer/added_vocabulary.h"

#include <algorithm>
#include <cctype>
#include <map>

#include "common/tokenizer/normalizer.h"
#include "common/tokenizer/unicode.h"

namespace tessera::tokenizer {
namespace {

bool same_flags(const AddedToken& a, const AddedToken& b) {
  return a.content == b.content && a.single_word == b.single_word && a.lstrip == b.lstrip &&
         a.rstrip == b.rstrip && a.normalized == b.normalized && a.special == b.special;
}

// The code point that ends text[0, end), or 0 if end == 0.
uint32_t code_point_before(std::string_view text, size_t end) {
  if (end == 0) return 0;
  size_t start = end - 1;
  while (start > 0 && (static_cast<uint8_t>(text[start]) & 0xC0) == 0x80) --start;
  return next_code_point(text, start);
}

}  // namespace

void AddedVocabulary::Trie::insert(std::string_view key, int32_t token) {
  if (key.empty()) return;
  first_byte[static_cast<uint8_t>(key[0])] = true;
  int32_t node = 0;
  for (char c : key) {
    auto byte = static_cast<uint8_t>(c);
    auto& children = nodes[node].children;
    auto it = std::lower_bound(children.begin(), children.end(), std::make_pair(byte, 0),
                               [](const auto& a, const auto& b) { return a.first < b.first; });
    if (it != children.end() && it->first == byte) {
      node = it->second;
    } else {
      int32_t child = static_cast<int32_t>(nodes.size());
      children.insert(it, {byte, child});
      nodes.emplace_back();  // invalidates `children`: not used afterwards
      node = child;
    }
  }
  nodes[node].token = token;
}

std::pair<int32_t, size_t> AddedVocabulary::Trie::longest(std::string_view text, size_t pos) const {
  std::pair<int32_t, size_t> best{-1, 0};
  int32_t node = 0;
  for (size_t i = pos; i < text.size(); ++i) {
    auto byte = static_cast<uint8_t>(text[i]);
    const auto& children = nodes[node].children;
    auto it = std::lower_bound(children.begin(), children.end(), std::make_pair(byte, 0),
                               [](const auto& a, const auto& b) { return a.first < b.first; });
    if (it == children.end() || it->first != byte) break;
    node = it->second;
    if (nodes[node].token >= 0) best = {nodes[node].token, i + 1 - pos};
  }
  return best;
}

AddedVocabulary::AddedVocabulary(
    std::vector<AddedToken> tokens,
    const std::function<std::optional<int32_t>(std::string_view)>& model_token_to_id,
    size_t model_vocab_size, const Normalizer* normalizer) {
  std::map<int32_t, AddedToken> by_id;
  std::map<int32_t, std::string> normalized_forms;
  std::vector<std::string> specials;
  auto next_id = static_cast<int32_t>(model_vocab_size);
  for (AddedToken& token : tokens) {
    if (token.content.empty()) continue;
    auto known = by_content_.find(token.content);
    if (known != by_content_.end() && same_flags(by_id[known->second], token)) continue;
    int32_t id;
    if (known != by_content_.end()) {
      id = known->second;
    } else if (auto model_id = model_token_to_id(token.content)) {
      id = *model_id;
    } else {
      id = next_id++;
    }
    token.id = id;
    if (token.normalized && normalizer != nullptr) {
      std::string form = token.content;
      normalizer->normalize(form);
      if (form != token.content) normalized_forms[id] = std::move(form);
    }
    by_content_[token.content] = id;
    if (token.special) specials.push_back(token.content);
    by_id[id] = std::move(token);
  }
  std::sort(specials.begin(), specials.end());
  specials.erase(std::unique(specials.begin(), specials.end()), specials.end());
  special_contents_ = std::move(specials);

  bool any_single_word = false;
  for (auto& [id, token] : by_id) {
    auto it = normalized_forms.find(id);
    match_forms_.push_back(it != normalized_forms.end() ? it->second : token.content);
    by_id_[id] = tokens_.size();
    auto index = static_cast<int32_t>(tokens_.size());
    (token.normalized ? normalized_trie_ : raw_trie_).insert(match_forms_.back(), index);
    any_single_word = any_single_word || token.single_word;
    tokens_.push_back(std::move(token));
  }
  if (any_single_word) {
    // Rust regex's Unicode \w: Alphabetic, marks, decimal digits, connector punctuation and the
    // join controls.
    auto regex = Regex::compile(R"([\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\x{200C}\x{200D}])");
    if (regex) word_char_ = std::move(regex).value();
  }
}

bool AddedVocabulary::is_word_char(uint32_t cp) const {
  if (cp < 0x80) return std::isalnum(static_cast<int>(cp)) != 0 || cp == '_';
  if (!word_char_) return false;
  std::string s;
  append_utf8(s, cp);
  return !word_char_->find_all(s).empty();
}

std::vector<Segment> AddedVocabulary::split(std::string_view text, bool normalized_tokens) const {
  const Trie& trie = normalized_tokens ? normalized_trie_ : raw_trie_;
  std::vector<Segment> segments;
  if (trie.nodes.size() == 1 || text.empty()) {
    segments.push_back({0, text.size(), -1});
    return segments;
  }
  size_t start_offset = 0;  // end of the last accepted match
  for (size_t pos = 0; pos < text.size();) {
    if (!trie.first_byte[static_cast<uint8_t>(text[pos])]) {
      ++pos;
      continue;
    }
    auto [index, length] = trie.longest(text, pos);
    if (index < 0) {
      ++pos;
      continue;
    }
    size_t start = pos, stop = pos + length;
    pos = stop;  // the next match is searched after this one, accepted or not
    const AddedToken& token = tokens_[index];
    if (token.single_word) {
      bool space_before = start == 0 || !is_word_char(code_point_before(text, start));
      size_t after = stop;
      bool space_after = stop == text.size() || !is_word_char(next_code_point(text, after));
      if (!space_before || !space_after) continue;
    }
    if (token.lstrip) {
      size_t new_start = start;
      while (new_start > 0) {
        size_t prev = new_start - 1;
        while (prev > 0 && (static_cast<uint8_t>(text[prev]) & 0xC0) == 0x80) --prev;
        size_t probe = prev;
        if (!is_whitespace(next_code_point(text, probe))) break;
        new_start = prev;
      }
      start = std::max(new_start, start_offset);
    }
    if (token.rstrip) {
      while (stop < text.size()) {
        size_t next = stop;
        if (!is_whitespace(next_code_point(text, next))) break;
        stop = next;
      }
    }
    if (start_offset < start) segments.push_back({start_offset, start, -1});
    segments.push_back({start, stop, token.id});
    start_offset = stop;
  }
  if (start_offset != text.size()) segments.push_back({start_offset, text.size(), -1});
  return segments;
}

std::optional<int32_t> AddedVocabulary::token_to_id(std::string_view content) const {
  auto it = by_content_.find(std::string(content));
  if (it == by_content_.end()) return std::nullopt;
  return it->second;
}

const AddedToken* AddedVocabulary::find(int32_t id) const {
  auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : &tokens_[it->second];
}

const std::string& AddedVocabulary::decode_form(int32_t id) const {
  return match_forms_[by_id_.at(id)];
}

bool AddedVocabulary::is_special_content(std::string_view token) const {
  return std::binary_search(special_contents_.begin(), special_contents_.end(), token);
}

}  // namespace tessera::tokenizer
