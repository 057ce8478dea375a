// The engine's Detokenizer over the model's tokenizer: each stream is an IncrementalDecoder
// (common/tokenizer/incremental_decoder.h), which decodes a small window around each new id
// (vLLM's incremental detokenization), so a token costs the same at position 10 and 10,000.
#pragma once

#include "driver/engine/detokenizer.h"

namespace tessera {

class Tokenizer;

class TokenizerDetokenizer final : public Detokenizer {
 public:
  // `tokenizer` is borrowed: it must outlive this and every stream started from it.
  explicit TokenizerDetokenizer(const Tokenizer& tokenizer) : tokenizer_(tokenizer) {}

  // The stream decodes its first ids after the prompt's last ones (so a leading space that a
  // SentencePiece decoder strips at the start of a text is kept), never emitting the prompt.
  std::unique_ptr<TextStream> start(std::span<const int32_t> prompt,
                                    bool skip_special_tokens) const override;

 private:
  const Tokenizer& tokenizer_;
};

}  // namespace tessera
