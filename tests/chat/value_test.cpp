// Values with Python semantics: float repr, str methods on UTF-8, json.dumps, comparisons.
#include "driver/chat/value.h"

#include <gtest/gtest.h>

#include "driver/chat/py_string.h"

namespace tessera::chat::jinja {
namespace {

TEST(ChatValueTest, FloatReprLikePython) {
  EXPECT_EQ(format_float(1.0), "1.0");
  EXPECT_EQ(format_float(0.1), "0.1");
  EXPECT_EQ(format_float(-2.5), "-2.5");
  EXPECT_EQ(format_float(1e16), "1e+16");
  EXPECT_EQ(format_float(1e15), "1000000000000000.0");
  EXPECT_EQ(format_float(123456.789), "123456.789");
  EXPECT_EQ(format_float(0.0001), "0.0001");
  EXPECT_EQ(format_float(0.00001), "1e-05");
  EXPECT_EQ(format_float(1.5e-7), "1.5e-07");
  EXPECT_EQ(format_float(1e300), "1e+300");
  EXPECT_EQ(format_float(0.1 + 0.2), "0.30000000000000004");
  EXPECT_EQ(format_float(0.0), "0.0");
  EXPECT_EQ(format_float(-0.0), "-0.0");
}

TEST(ChatValueTest, PythonStrOnUtf8) {
  std::string s = "h\xC3\xA9llo \xF0\x9F\x98\x80";  // "héllo 😀"
  EXPECT_EQ(py::length(s), 7u);
  EXPECT_EQ(py::slice(s, py::resolve_slice(7, 1, 3, 1)), "\xC3\xA9l");
  EXPECT_EQ(py::slice(s, py::resolve_slice(7, std::nullopt, std::nullopt, -1)),
            "\xF0\x9F\x98\x80 oll\xC3\xA9h");
  EXPECT_EQ(py::find(s, "l", false), 2);
  EXPECT_EQ(py::strip("\xE3\x80\x80 x\xC2\xA0\n", std::nullopt, true, true), "x");
  EXPECT_EQ(py::strip("xxaxx", std::string("x"), true, false), "axx");
  EXPECT_EQ(py::split("  a  b c ", std::nullopt, 1), (std::vector<std::string>{"a", "b c "}));
  EXPECT_EQ(py::rsplit("  a  b c ", std::nullopt, 1), (std::vector<std::string>{"  a  b", "c"}));
  EXPECT_EQ(py::split("a,,b", std::string(","), -1), (std::vector<std::string>{"a", "", "b"}));
  EXPECT_EQ(py::splitlines("a\r\nb\n\nc", false), (std::vector<std::string>{"a", "b", "", "c"}));
  EXPECT_EQ(py::replace("ab", "", "-", -1), "-a-b-");
  EXPECT_EQ(py::upper("stra\xC3\x9F"
                      "e \xC3\xA9"),
            "STRASSE \xC3\x89");
  EXPECT_EQ(py::repr("it's"), "\"it's\"");
  EXPECT_EQ(py::repr("a'\"\n\x01\xC2\xA0"), "'a\\'\"\\n\\x01\\xa0'");
  // Bytes that are not UTF-8 survive slicing and stripping unchanged.
  std::string bad = " \xFF\xFEx ";
  EXPECT_EQ(py::strip(bad, std::nullopt, true, true), "\xFF\xFEx");
  EXPECT_EQ(py::length(bad), 5u);
}

TEST(ChatValueTest, JsonDumpsLikePython) {
  Value v = from_json(nlohmann::ordered_json::parse(
      R"({"z": [1, 2.0, null, true, "\u0001\"\\\n\u00e9\ud83d\ude00"], "a": {}})"));
  JsonOptions compact;
  EXPECT_EQ(
      to_json(v, compact),
      "{\"z\": [1, 2.0, null, true, \"\\u0001\\\"\\\\\\n\xC3\xA9\xF0\x9F\x98\x80\"], \"a\": {}}");
  JsonOptions ascii;
  ascii.ensure_ascii = true;
  ascii.sort_keys = true;
  EXPECT_EQ(
      to_json(v, ascii),
      "{\"a\": {}, \"z\": [1, 2.0, null, true, \"\\u0001\\\"\\\\\\n\\u00e9\\ud83d\\ude00\"]}");
  JsonOptions indented;
  indented.indent = "  ";
  indented.item_separator = ",";
  EXPECT_EQ(to_json(from_json(nlohmann::ordered_json::parse(R"({"a": [1, {"b": 2}], "c": []})")),
                    indented),
            "{\n  \"a\": [\n    1,\n    {\n      \"b\": 2\n    }\n  ],\n  \"c\": []\n}");
}

TEST(ChatValueTest, EqualityAndOrder) {
  EXPECT_TRUE(equals(Value::integer(1), Value::number(1.0)));
  EXPECT_TRUE(equals(Value::boolean(true), Value::integer(1)));
  EXPECT_FALSE(equals(Value::list({Value::integer(1)}), Value::list({Value::integer(1)}, true)));
  EXPECT_TRUE(equals(Value::undefined("x"), Value::undefined("y")));
  EXPECT_EQ(compare(Value::string("b"), Value::string("a"), "<"), 1);
  EXPECT_EQ(compare(Value::list({Value::integer(1), Value::integer(2)}),
                    Value::list({Value::integer(1), Value::integer(3)}), "<"),
            -1);
  EXPECT_THROW(compare(Value::integer(1), Value::none(), "<"), RenderError);
}

TEST(ChatValueTest, DeepDataIsRefused) {
  nlohmann::ordered_json deep = 1;
  for (int i = 0; i < 1000; ++i) deep = nlohmann::ordered_json::array({deep});
  EXPECT_THROW(from_json(deep), RenderError);
  nlohmann::ordered_json fine = 1;
  for (int i = 0; i < 50; ++i) fine = nlohmann::ordered_json::array({fine});
  EXPECT_EQ(from_json(fine).depth(), 50);
}

}  // namespace
}  // namespace tessera::chat::jinja
