#include "driver/engine/tokenizer_detokenizer.h"

#include "common/tokenizer/incremental_decoder.h"
#include "common/tokenizer/tokenizer.h"

namespace tessera {
namespace {

class DecoderStream final : public TextStream {
 public:
  DecoderStream(const Tokenizer& tokenizer, bool skip_special, std::span<const int32_t> prompt)
      : decoder_(tokenizer, skip_special, prompt) {}
  std::string push(int32_t id) override { return decoder_.push(id); }
  std::string flush() override { return decoder_.flush(); }

 private:
  IncrementalDecoder decoder_;
};

}  // namespace

std::unique_ptr<TextStream> TokenizerDetokenizer::start(std::span<const int32_t> prompt,
                                                        bool skip_special_tokens) const {
  return std::make_unique<DecoderStream>(tokenizer_, skip_special_tokens, prompt);
}

}  // namespace tessera
