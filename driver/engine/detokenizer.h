// Streaming detokenization for the engine: one TextStream per request turns its generated ids
// into text as they arrive, O(1) work per id (the whole output is never decoded again).
//
// The engine only sees these interfaces; tokenizer_detokenizer.h has the implementation over the
// model's tokenizer, NoDetokenizer here is the one for runs that want ids only (benchmarks,
// vLLM's detokenize=False). Tests provide fakes.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

namespace tessera {

// The text of one request's generated ids, pushed one at a time. Not thread-safe; one per
// request.
class TextStream {
 public:
  virtual ~TextStream() = default;
  // Adds the next generated id; returns the text it completes: well-formed UTF-8, possibly
  // empty (an incomplete character is held back until an id completes it).
  virtual std::string push(int32_t id) = 0;
  // End of the stream: returns whatever is held back (an incomplete character decodes to
  // U+FFFD). The engine calls it once, when the request finishes.
  virtual std::string flush() = 0;
};

// Makes a TextStream per request; the tokenizer behind it is the model's. Must outlive the
// engine and every stream it made.
class Detokenizer {
 public:
  virtual ~Detokenizer() = default;
  // A stream for a request whose prompt is `prompt` (a stream may keep its last few ids as
  // decoding context; it never emits their text). Never null.
  virtual std::unique_ptr<TextStream> start(std::span<const int32_t> prompt,
                                            bool skip_special_tokens) const = 0;
};

// Ids only, no text: every stream returns "".
class NoDetokenizer final : public Detokenizer {
 public:
  std::unique_ptr<TextStream> start(std::span<const int32_t> prompt,
                                    bool skip_special_tokens) const override;
};

}  // namespace tessera
