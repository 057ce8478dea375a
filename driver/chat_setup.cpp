#include "driver/chat_setup.h"

#include <filesystem>
#include <utility>

#include "common/tokenizer/json_file.h"

namespace tessera {

Expected<std::optional<chat::ChatTemplate>> load_chat_template(const std::string& chat_template,
                                                               const std::string& model_dir,
                                                               const Tokenizer& tokenizer) {
  if (!chat_template.empty()) {
    std::string source = chat_template;
    std::error_code ec;
    if (std::filesystem::is_regular_file(chat_template, ec)) {
      TESSERA_ASSIGN_OR_RETURN(source, tokenizer::read_text_file(chat_template));
    }
    auto bos = tokenizer.bos_id();
    const auto& eos = tokenizer.eos_ids();
    auto parsed = chat::ChatTemplate::parse(
        source, bos ? tokenizer.id_to_token(*bos).value_or("") : "",
        eos.empty() ? "" : tokenizer.id_to_token(eos.front()).value_or(""));
    if (!parsed) return parsed.status().with_context("--chat-template");
    return std::optional<chat::ChatTemplate>(std::move(*parsed));
  }
  auto loaded = chat::ChatTemplate::load(model_dir + "/tokenizer_config.json");
  if (loaded) return std::optional<chat::ChatTemplate>(std::move(*loaded));
  if (loaded.status().code() != Code::kNotFound) return loaded.status();
  return std::optional<chat::ChatTemplate>();
}

}  // namespace tessera
