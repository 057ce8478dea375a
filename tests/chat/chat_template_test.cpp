// The public API: loading tokenizer_config.json variants, the render context, errors as Status.
#include "driver/chat/chat_template.h"

#include <filesystem>
#include <fstream>
#include <thread>

#include <unistd.h>

#include <gtest/gtest.h>

namespace tessera::chat {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

class ChatTemplateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("tessera_chat_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string write(const std::string& name, const std::string& text) {
    fs::path path = dir_ / name;
    std::ofstream(path) << text;
    return path.string();
  }

  fs::path dir_;
};

TEST_F(ChatTemplateTest, LoadsTemplateAndTokenObjects) {
  Json config = {{"chat_template",
                  "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
                  "{{ eos_token }}|{{ pad_token }}|{{ additional_special_tokens }}"},
                 {"bos_token", {{"content", "<s>"}, {"lstrip", false}}},
                 {"eos_token", "</s>"},
                 {"pad_token", {{"content", "<pad>"}}},
                 {"unk_token", nullptr},
                 {"additional_special_tokens", {"<a>", {{"content", "<b>"}}}}};
  auto t = ChatTemplate::load(write("tokenizer_config.json", config.dump()));
  ASSERT_TRUE(t.has_value()) << t.status().to_string();
  EXPECT_EQ(t->bos_token(), "<s>");
  EXPECT_EQ(t->eos_token(), "</s>");
  auto out = t->render({{"user", "hi"}}, false);
  ASSERT_TRUE(out.has_value()) << out.status().to_string();
  EXPECT_EQ(*out, "<s>hi</s>|<pad>|");  // transformers 5 passes no additional_special_tokens
}

TEST_F(ChatTemplateTest, NullTokensAreUndefined) {
  Json config = {
      {"chat_template", "{{ bos_token is defined }}/{{ eos_token }}/{{ unk_token is defined }}"},
      {"bos_token", nullptr},
      {"eos_token", "<|im_end|>"}};
  auto t = ChatTemplate::load(write("tokenizer_config.json", config.dump()));
  ASSERT_TRUE(t.has_value()) << t.status().to_string();
  EXPECT_EQ(t->bos_token(), "");
  EXPECT_EQ(*t->render({}, false), "False/<|im_end|>/False");
}

TEST_F(ChatTemplateTest, LoadsNamedTemplateList) {
  Json config = {{"chat_template",
                  {{{"name", "tool_use"}, {"template", "tools"}},
                   {{"name", "default"}, {"template", "default {{ messages | length }}"}}}}};
  auto t = ChatTemplate::load(write("tokenizer_config.json", config.dump()));
  ASSERT_TRUE(t.has_value()) << t.status().to_string();
  EXPECT_EQ(*t->render({{"user", "a"}, {"assistant", "b"}}, false), "default 2");

  Json no_default = {{"chat_template", {{{"name", "tool_use"}, {"template", "x"}}}}};
  auto bad = ChatTemplate::load(write("tokenizer_config.json", no_default.dump()));
  ASSERT_FALSE(bad.has_value());
  EXPECT_EQ(bad.status().code(), Code::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("tool_use"), std::string::npos);
}

TEST_F(ChatTemplateTest, PrefersChatTemplateJinjaBeside) {
  write("chat_template.jinja", "from file\n");
  auto t = ChatTemplate::load(write("tokenizer_config.json", R"({"eos_token": "</s>"})"));
  ASSERT_TRUE(t.has_value()) << t.status().to_string();
  EXPECT_EQ(*t->render({}, false), "from file");  // Jinja drops one trailing newline
}

TEST_F(ChatTemplateTest, LoadErrors) {
  auto missing = ChatTemplate::load((dir_ / "nope.json").string());
  EXPECT_EQ(missing.status().code(), Code::kNotFound);

  auto no_template = ChatTemplate::load(write("tokenizer_config.json", R"({"bos_token": "<s>"})"));
  EXPECT_EQ(no_template.status().code(), Code::kNotFound);
  EXPECT_NE(no_template.status().message().find("has no chat_template"), std::string::npos);

  auto not_json = ChatTemplate::load(write("tokenizer_config.json", "{not json"));
  EXPECT_EQ(not_json.status().code(), Code::kInvalidArgument);

  auto syntax = ChatTemplate::load(
      write("tokenizer_config.json", R"({"chat_template": "line one\n{{ a b }}"})"));
  ASSERT_FALSE(syntax.has_value());
  EXPECT_EQ(syntax.status().code(), Code::kInvalidArgument);
  EXPECT_NE(syntax.status().message().find("tokenizer_config.json"), std::string::npos);
  EXPECT_NE(syntax.status().message().find("line 2, column 6"), std::string::npos)
      << syntax.status().message();
}

TEST(ChatTemplateApiTest, ParseErrorNamesLineAndColumn) {
  auto t = ChatTemplate::parse("Hello\n  {{ messages | nope }}", "", "");
  ASSERT_FALSE(t.has_value());
  EXPECT_EQ(t.status().code(), Code::kInvalidArgument);
  EXPECT_EQ(t.status().message(),
            "chat template syntax error: line 2, column 17: No filter named 'nope'.");
}

TEST(ChatTemplateApiTest, ContextMatchesTransformers) {
  auto t = ChatTemplate::parse(
      "{{ tools is none }}/{{ documents is none }}/{{ add_generation_prompt }}/{{ bos_token }}/"
      "{{ eos_token }}/{{ enable_thinking is defined }}/{{ messages[0].reasoning_content }}",
      "<B>", "<E>");
  ASSERT_TRUE(t.has_value());
  ChatMessage m{"assistant", "x", "why"};
  EXPECT_EQ(*t->render({m}, true), "True/True/True/<B>/<E>/False/why");
  EXPECT_EQ(*t->render({m}, false, {{"enable_thinking", false}, {"tools", {1}}}),
            "False/True/False/<B>/<E>/True/why");
  nlohmann::json unordered = {{"enable_thinking", true}};  // converts to ordered_json
  EXPECT_EQ(*t->render({m}, false, unordered), "True/True/False/<B>/<E>/True/why");
}

TEST(ChatTemplateApiTest, RenderErrorsAreInvalidArgument) {
  auto t = ChatTemplate::parse(
      "{% if messages[0].role != 'user' %}{{ raise_exception('First message must be from the "
      "user, got ' ~ messages[0].role) }}{% endif %}ok",
      "", "");
  ASSERT_TRUE(t.has_value());
  auto out = t->render({{"system", "s"}}, false);
  ASSERT_FALSE(out.has_value());
  EXPECT_EQ(out.status().code(), Code::kInvalidArgument);
  EXPECT_EQ(out.status().message(), "First message must be from the user, got system");
  EXPECT_EQ(*t->render({{"user", "u"}}, false), "ok");

  auto bad_extra = t->render({{"user", "u"}}, false, nlohmann::json::array());
  EXPECT_EQ(bad_extra.status().code(), Code::kInvalidArgument);
  auto sets_messages = t->render({{"user", "u"}}, false, {{"messages", 1}});
  EXPECT_EQ(sets_messages.status().code(), Code::kInvalidArgument);
}

// Found by the fuzzer: raise_exception of an undefined name (or of '') gave an empty message.
TEST(ChatTemplateApiTest, AnExceptionWithNoMessageStillSaysWhatHappened) {
  for (const char* source : {"{{ raise_exception(no_such_name) }}", "{{ raise_exception('') }}"}) {
    auto t = ChatTemplate::parse(source, "", "");
    ASSERT_TRUE(t.has_value());
    auto out = t->render({{"user", "u"}}, false);
    ASSERT_FALSE(out.has_value());
    EXPECT_EQ(out.status().code(), Code::kInvalidArgument);
    EXPECT_EQ(out.status().message(), "the chat template raised an exception with no message")
        << source;
  }
}

TEST(ChatTemplateApiTest, RenderJsonPassesOpenAiMessagesThrough) {
  auto t = ChatTemplate::parse(
      "{% for m in messages %}{{ m.role }}:{% if m.content is string %}{{ m.content }}"
      "{% elif m.content is none %}(none){% else %}{{ m.content | map(attribute='text') | join }}"
      "{% endif %}{% for c in m.tool_calls | default([]) %}[{{ c.function.name }} "
      "{{ c.function.arguments | tojson }}]{% endfor %};{% endfor %}",
      "", "");
  ASSERT_TRUE(t.has_value());
  Json messages = Json::parse(R"([
    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    {"role": "assistant", "content": null, "tool_calls": [
      {"type": "function", "function": {"name": "f", "arguments": {"z": 1, "a": [true, null]}}}]}
  ])");
  EXPECT_EQ(*t->render_json(messages, false),
            R"(user:ab;assistant:(none)[f {"z": 1, "a": [true, null]}];)");
  EXPECT_EQ(t->render_json(Json::object(), false).status().code(), Code::kInvalidArgument);
}

TEST(ChatTemplateApiTest, CopiesShareAndRenderConcurrently) {
  auto parsed = ChatTemplate::parse(
      "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + m.content | length "
      "%}{% endfor %}{{ ns.n }}",
      "", "");
  ASSERT_TRUE(parsed.has_value());
  const ChatTemplate copy = *parsed;
  std::vector<ChatMessage> messages(50, ChatMessage{"user", "abcd", std::nullopt});
  std::vector<std::thread> threads;
  std::vector<std::string> results(8);
  for (size_t i = 0; i < results.size(); ++i) {
    threads.emplace_back([&, i] {
      for (int k = 0; k < 50; ++k) results[i] = *copy.render(messages, false);
    });
  }
  for (auto& th : threads) th.join();
  for (const std::string& r : results) EXPECT_EQ(r, "200");
}

}  // namespace
}  // namespace tessera::chat
