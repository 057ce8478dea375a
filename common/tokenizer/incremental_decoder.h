// Streaming detokenization: the text of generated ids, one id at a time, never cutting a UTF-8
// character.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "common/tokenizer/tokenizer.h"

namespace tessera {

// Streams the text of generated ids one id at a time without ever emitting a broken UTF-8
// sequence: bytes of an incomplete character are held back until it completes. The
// concatenation of every push() and the final flush() equals tokenizer.decode(ids) of all the
// pushed ids (vLLM's method: decode a small window before and after the new id, emit the
// difference once it does not end in U+FFFD). One per stream; not thread-safe; the tokenizer
// must outlive it.
//
// One exception to the equality, for ids that do not spell valid UTF-8: a SentencePiece
// ByteFallback decoder turns a whole run of <0xAB> byte tokens into U+FFFDs when a byte of the
// run is invalid, after characters of the run may already have been streamed. The stream then
// holds those characters where the full decode has U+FFFDs. Byte-level (GPT-2) decoding
// replaces only the bad bytes, so its streams always equal the full decode.
class IncrementalDecoder {
 public:
  // `context`: ids that precede the stream (e.g. the prompt's last ids). They are never
  // emitted, but the first ids decode as they would after them (a leading space that a
  // SentencePiece decoder strips at the start of a text is kept).
  IncrementalDecoder(const Tokenizer& tokenizer, bool skip_special_tokens,
                     std::span<const int32_t> context = {});

  // Adds one id; returns the text it completes (possibly empty), always well-formed UTF-8.
  std::string push(int32_t id);
  // Returns whatever is held back (an incomplete character decodes to U+FFFD, as in decode()):
  // call it at the end of the stream. Later pushes continue after the flushed ids.
  std::string flush();

 private:
  // decode(ids_[begin, end)).
  std::string decode_range(size_t begin, size_t end) const;

  const Tokenizer* tokenizer_;
  bool skip_special_tokens_;
  std::vector<int32_t> ids_;
  size_t prefix_offset_ = 0;  // start of the window decoded for context
  size_t read_offset_ = 0;    // ids before this one have been emitted
};

}  // namespace tessera
