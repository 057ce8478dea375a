#include "common/tokenizer/tokenizer_config.h"

#include <nlohmann/json.hpp>

#include "common/tokenizer/json_file.h"

namespace tessera {
namespace {

using nlohmann::json;

// transformers' "no limit" is int(1e30); anything this large means the same.
constexpr double kUnlimitedLength = 1e18;

std::optional<std::string> token_field(const json& config, const char* key) {
  if (!config.contains(key)) return std::nullopt;
  const json& value = config[key];
  if (value.is_string()) return value.get<std::string>();
  if (value.is_object() && value.contains("content")) return value["content"].get<std::string>();
  return std::nullopt;
}

std::optional<bool> bool_field(const json& config, const char* key) {
  if (!config.contains(key) || !config[key].is_boolean()) return std::nullopt;
  return config[key].get<bool>();
}

}  // namespace

Expected<TokenizerConfig> parse_tokenizer_config(std::string_view json_text,
                                                 std::string_view origin) {
  std::string where(origin);
  TESSERA_ASSIGN_OR_RETURN(json config, tokenizer::parse_json(json_text, origin));
  if (!config.is_object()) return invalid_argument(where + ": not a JSON object");
  TokenizerConfig out;
  try {
    out.bos_token = token_field(config, "bos_token");
    out.eos_token = token_field(config, "eos_token");
    out.pad_token = token_field(config, "pad_token");
    out.unk_token = token_field(config, "unk_token");
    out.add_bos_token = bool_field(config, "add_bos_token");
    out.add_eos_token = bool_field(config, "add_eos_token");
    out.legacy = bool_field(config, "legacy");
    out.add_prefix_space = bool_field(config, "add_prefix_space");
    if (config.contains("tokenizer_class") && config["tokenizer_class"].is_string()) {
      out.tokenizer_class = config["tokenizer_class"].get<std::string>();
    }
    out.clean_up_tokenization_spaces = config.value("clean_up_tokenization_spaces", false);
    if (config.contains("chat_template")) {
      const json& templates = config["chat_template"];
      if (templates.is_string()) {
        out.chat_template = templates.get<std::string>();
      } else if (templates.is_array()) {
        for (const json& entry : templates) {
          std::string name = entry.at("name").get<std::string>();
          std::string source = entry.at("template").get<std::string>();
          if (name == "default") out.chat_template = source;
          out.named_chat_templates.emplace_back(std::move(name), std::move(source));
        }
      } else if (!templates.is_null()) {
        return invalid_argument(where + ": chat_template is neither a string nor a list");
      }
    }
    if (config.contains("model_max_length") && config["model_max_length"].is_number()) {
      double length = config["model_max_length"].get<double>();
      if (length > 0 && length < kUnlimitedLength) {
        out.model_max_length = static_cast<int64_t>(length);
      }
    }
  } catch (const json::exception& e) {
    return invalid_argument(where + ": unexpected structure: " + e.what());
  }
  return out;
}

Status merge_generation_config(std::string_view json_text, std::string_view origin,
                               TokenizerConfig& config) {
  std::string where(origin);
  TESSERA_ASSIGN_OR_RETURN(json generation, tokenizer::parse_json(json_text, origin));
  if (!generation.is_object()) return invalid_argument(where + ": not a JSON object");
  try {
    if (generation.contains("eos_token_id")) {
      const json& eos = generation["eos_token_id"];
      auto add = [&](const json& id) -> Status {
        TESSERA_ASSIGN_OR_RETURN(
            int64_t v, tokenizer::json_integer(id, 0, INT32_MAX, where + ": eos_token_id"));
        config.generation_eos_ids.push_back(static_cast<int32_t>(v));
        return Status::ok();
      };
      if (eos.is_number_integer()) {
        TESSERA_RETURN_IF_ERROR(add(eos));
      } else if (eos.is_array()) {
        for (const json& id : eos) TESSERA_RETURN_IF_ERROR(add(id));
      }
    }
    if (generation.contains("bos_token_id") && generation["bos_token_id"].is_number_integer()) {
      TESSERA_ASSIGN_OR_RETURN(int64_t v,
                               tokenizer::json_integer(generation["bos_token_id"], 0, INT32_MAX,
                                                       where + ": bos_token_id"));
      config.generation_bos_id = static_cast<int32_t>(v);
    }
  } catch (const json::exception& e) {
    return invalid_argument(where + ": unexpected structure: " + e.what());
  }
  return Status::ok();
}

}  // namespace tessera
