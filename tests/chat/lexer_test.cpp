// Whitespace control as transformers configures Jinja: trim_blocks, lstrip_blocks, '-', '+'.
// Expected strings were checked against jinja2 3.1 with those settings.
#include "driver/chat/lexer.h"

#include <gtest/gtest.h>

#include "tests/chat/test_util.h"

namespace tessera::chat::jinja {
namespace {

using testing::render;

TEST(ChatLexerTest, TrimBlocksDropsOneNewlineAfterBlockTags) {
  EXPECT_EQ(render("{% if true %}\nA{% endif %}\nB"), "AB");
  EXPECT_EQ(render("{% if true %}\n\nA{% endif %}"), "\nA");
  EXPECT_EQ(render("{{ 'x' }}\nB"), "x\nB");                 // not after {{ }}
  EXPECT_EQ(render("{# c #}\nB"), "B");                      // comments too
  EXPECT_EQ(render("{% if true +%}\nx{% endif %}"), "\nx");  // '+' keeps it
}

TEST(ChatLexerTest, LstripBlocksDropsIndentBeforeBlockTags) {
  EXPECT_EQ(render("  {% if true %}\n  x\n  {% endif %}\n  {# c #}\ny"), "  x\ny");
  EXPECT_EQ(render("  {{ 'x' }}"), "  x");                    // not before {{ }}
  EXPECT_EQ(render("a  {% if true %}b{% endif %}"), "a  b");  // only alone on the line
  EXPECT_EQ(render("  {%+ if true %}x{% endif %}"), "  x");   // '+' keeps it
  EXPECT_EQ(render("\t{% if true %}\tA{% endif %}"), "\tA");
}

TEST(ChatLexerTest, MinusStripsAllWhitespace) {
  EXPECT_EQ(render("a \n {%- if true -%} \n b{% endif %}"), "ab");
  EXPECT_EQ(render("a  {{- 'x' -}}  \n b"), "axb");
  EXPECT_EQ(render("a {#- c -#} b"), "ab");
  EXPECT_EQ(render("a\xE3\x80\x80{%- if true %}b{% endif %}"), "ab");  // U+3000 is whitespace
  EXPECT_EQ(render("{{ 5 -1 }}|{{- 1 }}"), "4|1");  // '-' after {{ is a marker, not minus
}

TEST(ChatLexerTest, RawCommentsAndNewlines) {
  EXPECT_EQ(render("{% raw %}{{ x }}{% if %}{% endraw %}"), "{{ x }}{% if %}");
  EXPECT_EQ(render("a {# {{ not rendered }} #} b"), "a  b");
  EXPECT_EQ(render("a\r\nb\rc\n"), "a\nb\nc");  // newlines normalized, one trailing dropped
  EXPECT_EQ(render("x\n\n"), "x\n");
}

TEST(ChatLexerTest, Tokens) {
  std::vector<Token> tokens = tokenize("a{{ x.y[0] | f(1, 'q\\n') }}");
  std::vector<TokenType> types;
  for (const Token& t : tokens) types.push_back(t.type);
  using T = TokenType;
  EXPECT_EQ(types, (std::vector<T>{T::kData, T::kVariableBegin, T::kName, T::kOperator, T::kName,
                                   T::kOperator, T::kInteger, T::kOperator, T::kOperator, T::kName,
                                   T::kOperator, T::kInteger, T::kOperator, T::kString,
                                   T::kOperator, T::kVariableEnd, T::kEnd}));
  EXPECT_EQ(tokens[13].value, "q\n");
  // '}}' inside a dict literal does not end the tag.
  EXPECT_EQ(render("{{ {'a': {'b': 1}} }}"), "{'a': {'b': 1}}");
}

TEST(ChatLexerTest, LineColumnCountsCharacters) {
  std::string src = "ab\nh\xC3\xA9llo";
  EXPECT_EQ(line_column(src, 0), std::make_pair(1, 1));
  EXPECT_EQ(line_column(src, 3), std::make_pair(2, 1));
  EXPECT_EQ(line_column(src, 6), std::make_pair(2, 3));  // after "hé" (3 bytes)
}

TEST(ChatLexerTest, Errors) {
  EXPECT_EQ(render("x\n{{ 'abc }}"), "PARSE ERROR: line 2, column 4: unexpected char '''");
  EXPECT_EQ(render("{{ (1 }}"), "PARSE ERROR: line 1, column 7: unexpected '}', expected ')'");
  EXPECT_EQ(render("{# open"), "PARSE ERROR: line 1, column 1: Missing end of comment tag");
  EXPECT_EQ(render("{% raw %}x"), "PARSE ERROR: line 1, column 10: Missing end of raw directive");
  EXPECT_EQ(render("{{ x"),
            "PARSE ERROR: line 1, column 5: unexpected end of template, "
            "expected '}}'");
  EXPECT_EQ(render("{{ a ! b }}"), "PARSE ERROR: line 1, column 6: unexpected char '!'");
}

}  // namespace
}  // namespace tessera::chat::jinja
