#include "driver/engine/detokenizer.h"

namespace tessera {
namespace {

class EmptyStream final : public TextStream {
 public:
  std::string push(int32_t) override { return {}; }
  std::string flush() override { return {}; }
};

}  // namespace

std::unique_ptr<TextStream> NoDetokenizer::start(std::span<const int32_t>, bool) const {
  return std::make_unique<EmptyStream>();
}

}  // namespace tessera
