// The hermes tool-call parser, whole and streamed in every split: the same calls and content.
#include "driver/server/tool_parser.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

namespace tessera::server {
namespace {

TEST(HermesTest, TextWithoutCallsIsContent) {
  ToolOutput o = parse_hermes("Just text <tool but not a call");
  EXPECT_EQ(o.content, "Just text <tool but not a call");
  EXPECT_TRUE(o.calls.empty());
}

TEST(HermesTest, CallsBecomeToolCalls) {
  ToolOutput o = parse_hermes(
      "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
      "\"Paris\"}}\n</tool_call>\n<tool_call>{\"name\": \"now\", \"arguments\": {}}</tool_call>");
  EXPECT_EQ(o.content, "Let me check.\n");
  ASSERT_EQ(o.calls.size(), 2u);
  EXPECT_EQ(o.calls[0].name, "get_weather");
  EXPECT_EQ(nlohmann::json::parse(o.calls[0].arguments), nlohmann::json({{"city", "Paris"}}));
  EXPECT_EQ(o.calls[1].name, "now");
  EXPECT_EQ(o.calls[1].arguments, "{}");
  EXPECT_NE(o.calls[0].id, o.calls[1].id);
  EXPECT_EQ(o.calls[0].id.rfind("chatcmpl-tool-", 0), 0u);
  // Only calls: no content.
  EXPECT_FALSE(parse_hermes("<tool_call>{\"name\": \"f\"}</tool_call>").content.has_value());
  // A block that is not a call stays text.
  ToolOutput bad = parse_hermes("x <tool_call>not json</tool_call>");
  EXPECT_TRUE(bad.calls.empty());
  EXPECT_EQ(bad.content, "x <tool_call>not json</tool_call>");
}

TEST(HermesTest, StreamingInAnySplitGivesTheSameResult) {
  const std::string text =
      "Sure: <tool_call>{\"name\": \"a\", \"arguments\": {\"x\": 1}}</tool_call> and "
      "<tool_call>{\"name\": \"b\", \"arguments\": {}}</tool_call>";
  for (size_t step = 1; step <= text.size(); ++step) {
    HermesStream s;
    std::string content;
    std::vector<std::string> names;
    for (size_t at = 0; at < text.size(); at += step) {
      auto d = s.push(text.substr(at, step));
      content += d.content;
      for (const auto& c : d.calls) names.push_back(c.name);
      // Never a piece of a tag in the content.
      EXPECT_EQ(content.find('<'), std::string::npos) << "step " << step << ": " << content;
    }
    content += s.finish().content;
    EXPECT_EQ(content, "Sure: ") << "step " << step;
    EXPECT_EQ(names, (std::vector<std::string>{"a", "b"})) << "step " << step;
    EXPECT_EQ(s.calls(), 2);
  }
  // A held-back "<tool" that never becomes a tag comes out at the end.
  HermesStream s;
  EXPECT_EQ(s.push("a <tool").content, "a ");
  EXPECT_EQ(s.finish().content, "<tool");
}

}  // namespace
}  // namespace tessera::server
