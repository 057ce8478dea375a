// Decoders of tokenizer.json ("decoder"): turn the token strings of ids back into text, as Hugging
// Face tokenizers' decode_chain does.
//
// Supported types: ByteLevel (GPT-2 chars back to bytes, then lossy UTF-8), Replace (String
// pattern), ByteFallback (<0xAB> tokens to bytes), Fuse, Strip, Metaspace and Sequence of them;
// any other type fails to load, naming it.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "common/status.h"

namespace tessera::tokenizer {

class Decoder {
 public:
  virtual ~Decoder() = default;
  // Rewrites the list of token strings (a step may merge them). Thread-safe.
  virtual void decode_chain(std::vector<std::string>& tokens) const = 0;
  // True for a ByteLevel decoder on its own: each token then decodes to bytes of its own
  // (byte_level_bytes), and a list of tokens to those bytes concatenated, read as lossy UTF-8.
  virtual bool byte_level() const { return false; }
};

// A token's bytes under the ByteLevel decoder: each char mapped back through the byte alphabet,
// or, when a char is outside it (an added token), the token's UTF-8 as it is.
std::string byte_level_bytes(std::string_view token);

// Builds the decoder that `spec` (the "decoder" value of tokenizer.json) describes; nullptr for
// JSON null (then decode joins tokens with spaces). INVALID_ARGUMENT naming an unsupported type.
// May throw nlohmann::json::exception on a malformed structure.
Expected<std::unique_ptr<Decoder>> make_decoder(const nlohmann::json& spec);

}  // namespace tessera::tokenizer
