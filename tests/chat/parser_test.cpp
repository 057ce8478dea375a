// Syntax: precedence as in Jinja, literals, and syntax errors that name line and column.
#include "driver/chat/parser.h"

#include <gtest/gtest.h>

#include "tests/chat/test_util.h"

namespace tessera::chat::jinja {
namespace {

using testing::render;

TEST(ChatParserTest, Precedence) {
  EXPECT_EQ(render("{{ 1 + 2 * 3 }}|{{ (1 + 2) * 3 }}|{{ 2 ** 3 ** 2 }}|{{ -2 ** 2 }}"),
            "7|9|64|4");  // Jinja's ** is left-associative and binds below unary minus
  EXPECT_EQ(render("{{ ' a ' | trim ~ 'b' }}"), "ab");  // filters bind tighter than operators
  EXPECT_EQ(render("{{ 'a' ~ 1 + 2 }}"),                // ~ binds tighter than +
            "ERROR: can only concatenate str (not \"int\") to str");
  EXPECT_EQ(render("{{ not 1 in [1] }}|{{ 1 < 2 < 3 }}|{{ 3 > 2 > 2 }}|{{ 1 not in [2] }}"),
            "False|True|False|True");
  EXPECT_EQ(render("{{ 'y' if false else 'n' }}|{{ 'y' if false }}|{{ 1 if true else 2 + 3 }}"),
            "n||1");
  EXPECT_EQ(render("{{ -'3' | int }}"), "ERROR: bad operand type for unary -: 'str'");
  EXPECT_EQ(render("{{ x is not none and x is defined }}", {{"x", 1}}), "True");
  EXPECT_EQ(render("{{ 7 is divisibleby 7 }}{{ 7 is divisibleby(2) }}"), "TrueFalse");
}

TEST(ChatParserTest, Literals) {
  EXPECT_EQ(render(R"({{ 'a\nb\t\x41\u00e9\'' }}|{{ "q\"" 'adjacent' }}|{{ '\q' }})"),
            "a\nb\tA\xC3\xA9'|q\"adjacent|\\q");
  EXPECT_EQ(render("{{ 1_000 }}|{{ 0x1F }}|{{ 1.5e3 }}|{{ 2.0 }}|{{ True }}{{ none }}"),
            "1000|31|1500.0|2.0|TrueNone");
  EXPECT_EQ(render("{{ [1, 'a', [none]] }}|{{ (1,) }}|{{ () }}|{{ {'k': (1, 2)} }}|{{ [1,] }}"),
            "[1, 'a', [None]]|(1,)|()|{'k': (1, 2)}|[1]");
  EXPECT_EQ(render("{{ messages.0.role }}", {{"messages", {{{"role", "user"}}}}}), "user");
}

TEST(ChatParserTest, SyntaxErrorsNameLineAndColumn) {
  EXPECT_EQ(render("ok\n{{ a b }}"),
            "PARSE ERROR: line 2, column 6: expected token 'end of print statement', got 'b'");
  EXPECT_EQ(render("{% if %}"),
            "PARSE ERROR: line 1, column 7: Expected an expression, got 'end of statement block'");
  EXPECT_EQ(render("\n  {% foo %}"),
            "PARSE ERROR: line 2, column 6: Encountered unknown tag 'foo'.");
  EXPECT_EQ(render("{% if x %}\n{% endfor %}"),
            "PARSE ERROR: line 2, column 4: Encountered unknown tag 'endfor'. Jinja was looking "
            "for the following tags: 'elif' or 'else' or 'endif'. The innermost block that needs "
            "to be closed is 'if'.");
  EXPECT_EQ(render("{% for x in y %}"),
            "PARSE ERROR: line 1, column 17: Unexpected end of template. Jinja was looking for the "
            "following tags: 'endfor' or 'else'. The innermost block that needs to be closed is "
            "'for'.");
  EXPECT_EQ(render("{{ x | nope }}"), "PARSE ERROR: line 1, column 8: No filter named 'nope'.");
  EXPECT_EQ(render("{{ x is nope }}"), "PARSE ERROR: line 1, column 9: No test named 'nope'.");
  EXPECT_EQ(render("{% break %}"), "PARSE ERROR: line 1, column 10: 'break' outside of a for loop");
  EXPECT_EQ(render("{{ f(a=1, 2) }}"),
            "PARSE ERROR: line 1, column 11: invalid syntax for function call expression");
}

TEST(ChatParserTest, JinjaFiltersWeLackFailOnlyWhenReached) {
  EXPECT_EQ(render("{% if false %}{{ x | wordwrap }}{% endif %}ok"), "ok");
  EXPECT_EQ(render("{{ 'x' | wordwrap }}"),
            "ERROR: filter 'wordwrap' is not supported by this chat template renderer");
}

TEST(ChatParserTest, DeepNestingIsAnErrorNotACrash) {
  std::string parens = "{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}";
  EXPECT_NE(render(parens).find("template nests too deeply"), std::string::npos);
  std::string nots = "{{ ";
  for (int i = 0; i < 5000; ++i) nots += "not ";
  EXPECT_NE(render(nots + "x }}").find("nests too deeply"), std::string::npos);
  EXPECT_NE(render("{{ " + std::string(5000, '-') + "1 }}").find("nests too deeply"),
            std::string::npos);
  std::string ifs;
  for (int i = 0; i < 5000; ++i) ifs += "{% if true %}";
  EXPECT_NE(render(ifs).find("nests too deeply"), std::string::npos);
  std::string lists = "{{ " + std::string(5000, '[') + std::string(5000, ']') + " }}";
  EXPECT_NE(render(lists).find("nests too deeply"), std::string::npos);
  // Moderate nesting is fine.
  EXPECT_EQ(render("{{ " + std::string(20, '(') + "1" + std::string(20, ')') + " }}"), "1");
}

}  // namespace
}  // namespace tessera::chat::jinja
