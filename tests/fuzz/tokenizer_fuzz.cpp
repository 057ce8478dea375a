// Fuzzes tokenizer.json loading (Tokenizer::from_json) and encode / decode. The input is
// tokenizer.json's text, a NUL, tokenizer_config.json's text (may be empty), a NUL, and a text
// to encode. A tokenizer that loads encodes the text with and without special tokens, decodes
// the ids (and ids taken from the text's bytes, in and out of the vocab) with and without
// special tokens, and streams them through an IncrementalDecoder; decode output is always
// valid UTF-8, and encode without special tokens returns ids of the vocabulary.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/tokenizer/incremental_decoder.h"
#include "common/tokenizer/tokenizer.h"
#include "common/tokenizer/unicode.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tessera;
  auto parts = fuzz::split_input(data, size, 3);
  parts.resize(3);
  auto tok = Tokenizer::from_json(parts[0], parts[1], "fuzz/tokenizer.json");
  if (!tok) {
    FUZZ_CHECK(!tok.status().message().empty());
    return 0;
  }
  const Tokenizer& t = **tok;
  const std::string_view text = parts[2];
  for (bool special : {false, true}) {
    std::vector<int32_t> ids = t.encode(text, special);
    for (int32_t id : ids) {
      FUZZ_CHECK(id >= 0);
      // The post-processor's ids come from its own section, as in Hugging Face: only the
      // others are known to be in the vocab.
      if (!special) FUZZ_CHECK(t.id_to_token(id).has_value());
    }
    for (bool skip : {false, true}) {
      std::string decoded = t.decode(ids, skip);
      FUZZ_CHECK(tokenizer::is_valid_utf8(decoded));
    }
    IncrementalDecoder stream(t, /*skip_special_tokens=*/special);
    std::string streamed;
    for (int32_t id : ids) streamed += stream.push(id);
    streamed += stream.flush();
    FUZZ_CHECK(tokenizer::is_valid_utf8(streamed));
  }
  // Ids from the text's bytes, two at a time: in and out of the vocab, negative too.
  std::vector<int32_t> raw;
  for (size_t i = 0; i + 1 < text.size() && raw.size() < 256; i += 2) {
    raw.push_back(static_cast<int16_t>(static_cast<uint8_t>(text[i]) << 8 |
                                       static_cast<uint8_t>(text[i + 1])));
  }
  for (bool skip : {false, true}) {
    FUZZ_CHECK(tokenizer::is_valid_utf8(t.decode(raw, skip)));
  }
  for (int32_t id : raw) {
    if (auto token = t.id_to_token(id)) FUZZ_CHECK(t.token_to_id(*token).has_value());
    (void)t.is_special(id);
  }
  return 0;
}
