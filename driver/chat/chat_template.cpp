#include "driver/chat/chat_template.h"

#include <filesystem>
#include <fstream>
#include <new>
#include <sstream>

#include "driver/chat/evaluator.h"
#include "driver/chat/parser.h"
#include "driver/chat/value.h"

namespace tessera::chat {
namespace {

using jinja::Value;

Expected<std::string> read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return not_found("cannot read " + path.string());
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return unavailable("error reading " + path.string());
  return text.str();
}

// A special token as tokenizer_config.json writes it: "<s>" or {"content": "<s>", ...}.
std::optional<std::string> token_text(const nlohmann::ordered_json& j) {
  if (j.is_string()) return j.get<std::string>();
  if (j.is_object() && j.contains("content") && j["content"].is_string()) {
    return j["content"].get<std::string>();
  }
  return std::nullopt;
}

Expected<std::string> template_source(const nlohmann::ordered_json& config,
                                      const std::filesystem::path& config_path) {
  std::filesystem::path jinja_file = config_path.parent_path() / "chat_template.jinja";
  std::error_code ec;
  if (std::filesystem::is_regular_file(jinja_file, ec)) return read_file(jinja_file);
  auto it = config.find("chat_template");
  if (it == config.end() || it->is_null()) {
    return not_found(config_path.string() +
                     " has no chat_template (and there is no chat_template.jinja beside it)");
  }
  if (it->is_string()) return it->get<std::string>();
  if (it->is_array()) {  // [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
    std::string names;
    for (const auto& entry : *it) {
      if (!entry.is_object() || !entry.contains("name") || !entry.contains("template")) continue;
      std::string name = entry["name"].is_string() ? entry["name"].get<std::string>() : "";
      if (name == "default" && entry["template"].is_string()) {
        return entry["template"].get<std::string>();
      }
      names += (names.empty() ? "" : ", ") + name;
    }
    return invalid_argument(config_path.string() + ": no chat template named 'default' among [" +
                            names + "]");
  }
  return invalid_argument(config_path.string() + ": chat_template is neither a string nor a list");
}

Value message_value(const ChatMessage& m) {
  std::vector<std::pair<std::string, Value>> items;
  items.emplace_back("role", Value::string(m.role));
  items.emplace_back("content", Value::string(m.content));
  if (m.reasoning_content) {
    items.emplace_back("reasoning_content", Value::string(*m.reasoning_content));
  }
  return Value::dict(std::move(items));
}

}  // namespace

Expected<ChatTemplate> ChatTemplate::parse(std::string source, std::string bos_token,
                                           std::string eos_token) {
  auto parsed = jinja::parse_template(source);
  if (!parsed) return parsed.status().with_context("chat template syntax error");
  ChatTemplate t;
  t.template_ = std::move(parsed).value();
  t.special_tokens_ = {{"bos_token", std::move(bos_token)}, {"eos_token", std::move(eos_token)}};
  return t;
}

Expected<ChatTemplate> ChatTemplate::load(const std::string& tokenizer_config_path) {
  TESSERA_ASSIGN_OR_RETURN(std::string text, read_file(tokenizer_config_path));
  auto config = nlohmann::ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (config.is_discarded() || !config.is_object()) {
    return invalid_argument(tokenizer_config_path + " is not a JSON object");
  }
  TESSERA_ASSIGN_OR_RETURN(std::string source, template_source(config, tokenizer_config_path));
  auto parsed = jinja::parse_template(source);
  if (!parsed) {
    return parsed.status().with_context(tokenizer_config_path + ": chat template syntax error");
  }
  ChatTemplate t;
  t.template_ = std::move(parsed).value();
  for (const char* key : {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                          "cls_token", "mask_token"}) {
    auto it = config.find(key);
    if (it == config.end()) continue;
    if (auto text = token_text(*it)) t.special_tokens_.emplace_back(key, *text);
  }
  return t;
}

const std::string& ChatTemplate::source() const { return template_->source; }

const std::string& ChatTemplate::token(std::string_view name) const {
  static const std::string kEmpty;
  for (const auto& [key, value] : special_tokens_) {
    if (key == name) return value;
  }
  return kEmpty;
}

const std::string& ChatTemplate::bos_token() const { return token("bos_token"); }
const std::string& ChatTemplate::eos_token() const { return token("eos_token"); }

namespace {

// Renders with the context transformers builds; every error becomes a Status here.
Expected<std::string> render_with(
    const jinja::Template& tmpl, const std::function<Value()>& make_messages,
    bool add_generation_prompt,
    const std::vector<std::pair<std::string, std::string>>& special_tokens,
    const nlohmann::ordered_json& extra) {
  if (!extra.is_null() && !extra.is_object()) {
    return invalid_argument("chat template extra_context must be a JSON object");
  }
  if (extra.is_object() &&
      (extra.contains("messages") || extra.contains("add_generation_prompt"))) {
    return invalid_argument(
        "chat template extra_context may not set messages or add_generation_prompt");
  }
  try {
    std::vector<std::pair<std::string, Value>> context;
    context.emplace_back("messages", make_messages());
    context.emplace_back("tools", Value::none());
    context.emplace_back("documents", Value::none());
    context.emplace_back("add_generation_prompt", Value::boolean(add_generation_prompt));
    for (const auto& [key, value] : special_tokens) context.emplace_back(key, Value::string(value));
    if (extra.is_object()) {
      for (auto it = extra.begin(); it != extra.end(); ++it) {
        Value v = jinja::from_json(it.value());
        bool replaced = false;
        for (auto& [key, existing] : context) {
          if (key == it.key()) {
            existing = v;
            replaced = true;
          }
        }
        if (!replaced) context.emplace_back(it.key(), std::move(v));
      }
    }
    return jinja::render_template(tmpl, context);
  } catch (const jinja::RenderError& e) {
    return invalid_argument(e.what());
  } catch (const std::bad_alloc&) {
    return resource_exhausted("out of memory rendering the chat template");
  } catch (const std::exception& e) {
    return internal_error(std::string("chat template renderer failed: ") + e.what());
  }
}

}  // namespace

Expected<std::string> ChatTemplate::render(const std::vector<ChatMessage>& messages,
                                           bool add_generation_prompt,
                                           const nlohmann::ordered_json& extra_context) const {
  auto make_messages = [&] {
    std::vector<Value> items;
    items.reserve(messages.size());
    for (const ChatMessage& m : messages) items.push_back(message_value(m));
    return Value::list(std::move(items));
  };
  return render_with(*template_, make_messages, add_generation_prompt, special_tokens_,
                     extra_context);
}

Expected<std::string> ChatTemplate::render_json(const nlohmann::ordered_json& messages,
                                                bool add_generation_prompt,
                                                const nlohmann::ordered_json& extra_context) const {
  if (!messages.is_array()) return invalid_argument("chat messages must be a JSON array");
  return render_with(
      *template_, [&] { return jinja::from_json(messages); }, add_generation_prompt,
      special_tokens_, extra_context);
}

}  // namespace tessera::chat
