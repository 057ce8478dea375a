// Runtime semantics: loops, scoping, namespaces, macros, undefined values, filters, and the
// limits that keep any template from hanging or crashing. Expected strings match jinja2 3.1.
#include "driver/chat/evaluator.h"

#include <gtest/gtest.h>

#include "tests/chat/test_util.h"

namespace tessera::chat::jinja {
namespace {

using testing::render;
using Json = nlohmann::ordered_json;

const Json kMessages = {{"messages", Json::parse(R"([{"role": "system", "content": "s"},
                                 {"role": "user", "content": "u1"},
                                 {"role": "assistant", "content": "a1"}])")}};

TEST(ChatEvaluatorTest, LoopVariables) {
  EXPECT_EQ(
      render("{% for m in messages %}{{ loop.index0 }}{{ loop.index }}{{ loop.revindex }}"
             "{{ loop.revindex0 }}{{ loop.length }}{{ loop.first }}{{ loop.last }} {% endfor %}",
             kMessages),
      "01323TrueFalse 12213FalseFalse 23103FalseTrue ");
  EXPECT_EQ(render("{% for x in [1, 2, 3] %}{{ loop.previtem }}-{{ loop.nextitem }}|{% endfor %}"),
            "-2|1-3|2-|");
  EXPECT_EQ(render("{% for x in [1, 2, 3] %}{{ loop.cycle('a', 'b') }}{% endfor %}"), "aba");
  EXPECT_EQ(render("{% for x in [1, 2] %}{% for y in 'ab' %}{{ loop.index }}{{ y }}{% endfor %}"
                   "{{ loop.index }};{% endfor %}"),
            "1a2b1;1a2b2;");
  EXPECT_EQ(render("[{{ loop }}]"), "[]");
  EXPECT_EQ(render("{{ loop.index }}"), "ERROR: 'loop' is undefined");
}

TEST(ChatEvaluatorTest, LoopForms) {
  EXPECT_EQ(render("{% for m in messages if m.role != 'system' %}{{ loop.index }}/{{ loop.length }}"
                   "{{ m.content }} {% endfor %}",
                   kMessages),
            "1/2u1 2/2a1 ");
  EXPECT_EQ(render("{% for x in [] %}a{% else %}empty{% endfor %}"), "empty");
  EXPECT_EQ(render("{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }};{% endfor %}"),
            "a=1;b=2;");
  EXPECT_EQ(render("{% for k in {'b': 1, 'a': 2} %}{{ k }}{% endfor %}"), "ba");  // keys, in order
  EXPECT_EQ(render("{% for c in 'h\xC3\xA9' %}[{{ c }}]{% endfor %}"), "[h][\xC3\xA9]");
  EXPECT_EQ(render("{% for i in range(9) %}{% if i == 1 %}{% continue %}{% endif %}"
                   "{% if i == 4 %}{% break %}{% endif %}{{ i }}{% endfor %}"),
            "023");
  EXPECT_EQ(render("{% for x in undefined_thing %}x{% endfor %}ok"), "ok");
  EXPECT_EQ(render("{% for x in none %}{% endfor %}"), "ERROR: 'NoneType' object is not iterable");
  EXPECT_EQ(render("{% for a, b in [[1, 2], [3]] %}{% endfor %}"),
            "ERROR: not enough values to unpack (expected 2, got 1)");
}

TEST(ChatEvaluatorTest, Scoping) {
  // A loop iteration has its own variables; {% if %} has none.
  EXPECT_EQ(render("{% set x = 'out' %}{% for i in [1, 2] %}{% if loop.first %}{% set x = 'in' %}"
                   "{% endif %}{{ x }}{% endfor %}{{ x }}"),
            "inoutout");
  EXPECT_EQ(render("{% if true %}{% set y = 1 %}{% endif %}{{ y }}"), "1");
  EXPECT_EQ(render("{% with a = 1 %}{{ a }}{% endwith %}[{{ a }}]"), "1[]");
  EXPECT_EQ(render("{% set x %}inner {{ 1 + 1 }}{% endset %}[{{ x }}]"), "[inner 2]");
  EXPECT_EQ(render("{% set a, b = 1, 2 %}{{ a }}{{ b }}"), "12");
  // Macros see the template's top level and their own arguments, not the caller's loop.
  EXPECT_EQ(
      render("{% set g = 1 %}{% macro f() %}{{ g }}{% set g = 2 %}{{ g }}{{ i }}{% endmacro %}"
             "{% for i in [7] %}{{ f() }}{% endfor %}{{ g }}"),
      "121");
}

TEST(ChatEvaluatorTest, Namespaces) {
  EXPECT_EQ(render("{% set ns = namespace(found=false, n=0) %}{% for m in messages %}"
                   "{% set ns.n = ns.n + 1 %}{% if m.role == 'user' %}{% set ns.found = true %}"
                   "{% endif %}{% endfor %}{{ ns.found }} {{ ns.n }} {{ ns }}",
                   kMessages),
            "True 3 <Namespace {'found': True, 'n': 3}>");
  EXPECT_EQ(render("{% set x = 1 %}{% set x.a = 2 %}"),
            "ERROR: cannot assign attribute on non-namespace object");
  // A namespace that holds itself renders (and its memory is released afterwards).
  EXPECT_EQ(render("{% set ns = namespace() %}{% set ns.me = ns %}{{ ns.me.me is defined }}"),
            "True");
  EXPECT_NE(render("{% set ns = namespace() %}{% set ns.me = ns %}{{ ns }}").find("ERROR"),
            std::string::npos);
}

TEST(ChatEvaluatorTest, Macros) {
  EXPECT_EQ(render("{% macro m(a, b='d') %}{{ a }}-{{ b }}{% endmacro %}{{ m(1) }}|{{ m(1, 2) }}|"
                   "{{ m(b=3, a=4) }}|{{ m() }}|{{ m }}"),
            "1-d|1-2|4-3|-d|<Macro 'm'>");
  EXPECT_EQ(render("{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}"),
            "ERROR: macro 'm' takes not more than 1 argument(s)");
  EXPECT_EQ(render("{% macro m(a) %}{% endmacro %}{{ m(z=1) }}"),
            "ERROR: macro 'm' takes no keyword argument 'z'");
  EXPECT_EQ(render("{% macro f(n) %}{{ n }}{% if n > 0 %}{{ f(n - 1) }}{% endif %}{% endmacro %}"
                   "{{ f(3) }}"),
            "3210");
}

TEST(ChatEvaluatorTest, UndefinedBehavesLikeJinjaDefault) {
  EXPECT_EQ(
      render("[{{ nope }}]{{ nope is defined }}{{ nope is undefined }}{{ not nope }}"
             "{{ nope | length }}{{ nope ~ 'x' }}{{ nope | default('d') }}{{ nope == nope }}"),
      "[]FalseTrueTrue0xdTrue");
  const Json m = {{"m", {{"a", 1}}}};
  EXPECT_EQ(render("{{ m.missing is defined }}|{{ m['missing'] }}|{{ m.a }}", m), "False||1");
  EXPECT_EQ(render("{{ m.missing.deeper }}", m), "ERROR: 'dict object' has no attribute 'missing'");
  EXPECT_EQ(render("{{ nope.attr }}"), "ERROR: 'nope' is undefined");
  EXPECT_EQ(render("{{ nope + 1 }}"), "ERROR: 'nope' is undefined");
  EXPECT_EQ(render("{{ nope() }}"), "ERROR: 'nope' is undefined");
  EXPECT_EQ(render("{{ [1].startswith('a') }}"),
            "ERROR: 'list object' has no attribute 'startswith'");
  EXPECT_EQ(render("{{ [1, 2][5] }}|{{ 'ab'[9] }}|{{ none.x }}"), "||");
}

TEST(ChatEvaluatorTest, PythonValueSemantics) {
  EXPECT_EQ(
      render("{{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** -1 }} {{ true + 1 }}"),
      "3 -4 2 3.5 0.5 2");
  EXPECT_EQ(render("{{ 0.1 + 0.2 }} {{ 1e16 }} {{ 1e15 }} {{ 1e-5 }} {{ 3.0 * 2 }}"),
            "0.30000000000000004 1e+16 1000000000000000.0 1e-05 6.0");
  EXPECT_EQ(render("{{ 'ab' * 2 }} {{ [0] * 2 }} {{ [1] + [2] }} {{ (1, 'a') }}"),
            "abab [0, 0] [1, 2] (1, 'a')");
  EXPECT_EQ(render("{{ {'a': [1, 'b', none, true]} }} {{ [\"it's\"] }} {{ ['\\n'] }}"),
            "{'a': [1, 'b', None, True]} [\"it's\"] ['\\n']");
  EXPECT_EQ(render("{{ 1 == 1.0 }}{{ true == 1 }}{{ '1' == 1 }}{{ [1] == (1,) }}{{ 'b' > 'a' }}"),
            "TrueTrueFalseFalseTrue");
  EXPECT_EQ(render("{{ 1 + 'a' }}"), "ERROR: unsupported operand type(s) for +: 'int' and 'str'");
  EXPECT_EQ(render("{{ 1 < 'a' }}"),
            "ERROR: '<' not supported between instances of 'int' and 'str'");
  EXPECT_EQ(render("{{ 1 // 0 }}"), "ERROR: integer division or modulo by zero");
  EXPECT_EQ(render("{{ 9223372036854775807 + 1 }}"),
            "ERROR: integer overflow (template integers are 64-bit)");
  EXPECT_EQ(render("{{ [1].append(2) }}"),
            "ERROR: access to attribute 'append' of 'list' object is unsafe.");
}

TEST(ChatEvaluatorTest, StringMethodsAndSlices) {
  EXPECT_EQ(render("{{ s.split('</think>')[-1].lstrip('\\n') }}|"
                   "{{ s.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') }}",
                   {{"s", "<think>\nwhy\n</think>\n\nanswer"}}),
            "answer|why");
  EXPECT_EQ(
      render("{{ 'abc'[::-1] }}{{ 'h\xC3\xA9llo'[1:3] }}{{ [1, 2, 3][1:] }}{{ [1, 2, 3][::-2] }}"
             "{{ 'abc'[-1] }}{{ 'abc'[5:] }}"),
      "cba\xC3\xA9l[2, 3][3, 1]c");
  EXPECT_EQ(
      render("{{ ' a '.strip() }}|{{ 'a,b,,c'.split(',') }}|{{ ' a  b '.split() }}|"
             "{{ 'abc'.startswith(('x', 'a')) }}|{{ 'Hi'.upper() }}|{{ 'a-b-c'.rsplit('-', 1) }}"),
      "a|['a', 'b', '', 'c']|['a', 'b']|True|HI|['a-b', 'c']");
  EXPECT_EQ(render("{{ 'abc'[::0] }}"), "ERROR: slice step cannot be zero");
  EXPECT_EQ(render("{{ 5[1:] }}"), "ERROR: 'int' object is not subscriptable");
}

TEST(ChatEvaluatorTest, Filters) {
  EXPECT_EQ(
      render("{{ '  x \\n' | trim }}|{{ 'xyx' | trim('x') }}|{{ [1, 2] | length }}|"
             "{{ 'h\xC3\xA9' | length }}|{{ 'aB' | upper }}{{ 'aB' | lower }}|{{ 5 | string }}"),
      "x|y|2|2|ABab|5");
  EXPECT_EQ(render("{{ [3, 1, 2] | first }}{{ [3, 1, 2] | last }}|{{ [] | first }}|"
                   "{{ ['a', 'b'] | join(', ') }}|{{ 'a b a' | replace('a', 'x') }}|"
                   "{{ none | default('d') }}|{{ '' | default('d', true) }}"),
            "32||a, b|x b x|None|d");
  EXPECT_EQ(render("{{ messages | map(attribute='role') | join('/') }}|"
                   "{{ messages | selectattr('role', 'equalto', 'user') | list | length }}|"
                   "{{ messages | rejectattr('role', 'in', ['system']) | map(attribute='content') "
                   "| list }}",
                   kMessages),
            "system/user/assistant|1|['u1', 'a1']");
  EXPECT_EQ(render("{{ [3, 1, 2] | sort | list }}{{ [1, 2, 2] | unique | list }}{{ [1, 2] | sum }}"
                   "{{ [1, 5, 2] | max }}{{ 'abc' | reverse }}{{ -3 | abs }}{{ '12' | int + 1 }}"),
            "[1, 2, 3][1, 2]35cba313");
  EXPECT_EQ(
      render("{{ 'a\\nb\\n\\nc' | indent(2) }}|{{ 'x' | indent(2, true) }}|{{ 'ab cd' | title }}"
             "|{{ 'ab CD' | capitalize }}|{{ {'a': 1} | items | list }}"),
      "a\n  b\n\n  c|  x|Ab Cd|Ab cd|[('a', 1)]");
}

TEST(ChatEvaluatorTest, ToJson) {
  EXPECT_EQ(render("{{ {'b': 1, 'a': [1.5, none, true, 'q\"\\n\xC3\xA9']} | tojson }}"),
            "{\"b\": 1, \"a\": [1.5, null, true, \"q\\\"\\n\xC3\xA9\"]}");
  EXPECT_EQ(render("{{ {'a': {'b': []}, 'c': {}} | tojson(indent=2) }}"),
            "{\n  \"a\": {\n    \"b\": []\n  },\n  \"c\": {}\n}");
  EXPECT_EQ(render("{{ {'b': 1, 'a': 2} | tojson(sort_keys=true) }}|"
                   "{{ '\xC3\xA9' | tojson(ensure_ascii=true) }}|{{ [1, 2] | "
                   "tojson(separators=(',', ':')) }}"),
            "{\"a\": 2, \"b\": 1}|\"\\u00e9\"|[1,2]");
  EXPECT_EQ(render("{{ nope | tojson }}"),
            "ERROR: Object of type Undefined is not JSON serializable");
}

TEST(ChatEvaluatorTest, Globals) {
  EXPECT_EQ(render("{{ raise_exception('Only user and assistant roles are supported!') }}"),
            "ERROR: Only user and assistant roles are supported!");
  EXPECT_EQ(render("{{ range(3) | list }}{{ range(5, 0, -2) | list }}{{ dict(a=1) }}"),
            "[0, 1, 2][5, 3, 1]{'a': 1}");
  std::string year = render("{{ strftime_now('%Y') }}");
  EXPECT_EQ(year.size(), 4u);
  EXPECT_EQ(year.substr(0, 1), "2");
}

TEST(ChatEvaluatorTest, LimitsStopRunawayTemplates) {
  EXPECT_NE(
      render("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
          .find("ERROR: template loops ran more than"),
      std::string::npos);
  EXPECT_NE(
      render("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}").find("ERROR: macro calls nest"),
      std::string::npos);
  EXPECT_EQ(render("{{ range(10 ** 12) | length }}"), "ERROR: range too large");
  EXPECT_EQ(render("{{ 'a' * 10 ** 12 }}"), "ERROR: string too long");
  EXPECT_EQ(render("{% set ns = namespace(s='ab') %}{% for i in range(64) %}"
                   "{% set ns.s = ns.s ~ ns.s %}{% endfor %}"),
            "ERROR: string too long");
  EXPECT_NE(render("{% set ns = namespace(x=[]) %}{% for i in range(1000) %}"
                   "{% set ns.x = [ns.x] %}{% endfor %}")
                .find("ERROR: value nests deeper than"),
            std::string::npos);
  RenderLimits small;
  small.max_steps = 1000;
  EXPECT_NE(render("{% for i in range(10000) %}{{ i }}{% endfor %}", Json::object(), small)
                .find("ERROR: template evaluation exceeded 1000 steps"),
            std::string::npos);
  small = RenderLimits{};
  small.max_output_bytes = 100;
  EXPECT_NE(render("{% for i in range(1000) %}xx{% endfor %}", Json::object(), small)
                .find("ERROR: rendered text exceeds 100 bytes"),
            std::string::npos);
}

}  // namespace
}  // namespace tessera::chat::jinja
