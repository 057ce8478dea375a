#include "common/tokenizer/incremental_decoder.h"

#include <algorithm>
#include <string_view>

namespace tessera {
namespace {

// Context ids kept before the stream (vLLM keeps 5): enough for a decoder to see what precedes.
constexpr size_t kContextIds = 5;
// Emitted ids are dropped from the front once this many pile up.
constexpr size_t kTrimThreshold = 64;

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";

bool ends_with_replacement(const std::string& text) {
  return text.size() >= kReplacement.size() &&
         text.compare(text.size() - kReplacement.size(), kReplacement.size(), kReplacement) == 0;
}

// The part of `text` after `prefix`, cut at a character boundary. When `prefix` is not a prefix
// of `text` (a decoder rewrote earlier text), the longest common prefix is taken instead.
std::string suffix_after(const std::string& text, const std::string& prefix) {
  size_t cut = 0;
  size_t limit = std::min(text.size(), prefix.size());
  while (cut < limit && text[cut] == prefix[cut]) ++cut;
  while (cut > 0 && cut < text.size() && (static_cast<uint8_t>(text[cut]) & 0xC0) == 0x80) --cut;
  return text.substr(cut);
}

}  // namespace

IncrementalDecoder::IncrementalDecoder(const Tokenizer& tokenizer, bool skip_special_tokens,
                                       std::span<const int32_t> context)
    : tokenizer_(&tokenizer), skip_special_tokens_(skip_special_tokens) {
  size_t keep = std::min(context.size(), kContextIds);
  ids_.assign(context.end() - static_cast<ptrdiff_t>(keep), context.end());
  read_offset_ = ids_.size();
}

std::string IncrementalDecoder::decode_range(size_t begin, size_t end) const {
  return tokenizer_->decode(std::span<const int32_t>(ids_).subspan(begin, end - begin),
                            skip_special_tokens_);
}

std::string IncrementalDecoder::push(int32_t id) {
  ids_.push_back(id);
  std::string prefix_text = decode_range(prefix_offset_, read_offset_);
  std::string new_text = decode_range(prefix_offset_, ids_.size());
  if (new_text.size() <= prefix_text.size() || ends_with_replacement(new_text)) {
    return {};  // nothing new, or an incomplete character at the end: wait for more ids
  }
  std::string out = suffix_after(new_text, prefix_text);
  prefix_offset_ = read_offset_;
  read_offset_ = ids_.size();
  if (prefix_offset_ >= kTrimThreshold) {
    ids_.erase(ids_.begin(), ids_.begin() + static_cast<ptrdiff_t>(prefix_offset_));
    read_offset_ -= prefix_offset_;
    prefix_offset_ = 0;
  }
  return out;
}

std::string IncrementalDecoder::flush() {
  std::string out;
  if (read_offset_ < ids_.size()) {
    std::string prefix_text = decode_range(prefix_offset_, read_offset_);
    std::string new_text = decode_range(prefix_offset_, ids_.size());
    out = suffix_after(new_text, prefix_text);
  }
  // Later pushes continue after everything pushed so far, with its last ids as context.
  read_offset_ = ids_.size();
  prefix_offset_ = read_offset_ - std::min(read_offset_, kContextIds);
  return out;
}

}  // namespace tessera
