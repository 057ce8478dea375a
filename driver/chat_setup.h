// The chat template a model command uses: one loader for `tessera serve --chat-template` and the
// Python module's LLM.chat(chat_template=...) / get_tokenizer().apply_chat_template.
#pragma once

#include <optional>
#include <string>

#include "common/status.h"
#include "common/tokenizer/tokenizer.h"
#include "driver/chat/chat_template.h"

namespace tessera {

// `chat_template` when given: a file, or the template itself (its bos/eos tokens the
// tokenizer's); else the model's tokenizer_config.json's (or chat_template.jinja beside it).
// nullopt when the model has none and none was given; INVALID_ARGUMENT for a syntax error
// (naming where it came from) or an unreadable file.
Expected<std::optional<chat::ChatTemplate>> load_chat_template(const std::string& chat_template,
                                                               const std::string& model_dir,
                                                               const Tokenizer& tokenizer);

}  // namespace tessera
