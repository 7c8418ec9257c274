// The chat-template engine on what templates rely on, each against the text jinja2 gives (as
// transformers configures it: trim_blocks, lstrip_blocks); real templates are compared with
// jinja2 itself in tests/tokenizer/chat_template_parity.py.
#include <gtest/gtest.h>

#include "test_util.h"
#include "torchspeed/data/chat_template.h"

using torchspeed::data::ChatTemplate;
using json = nlohmann::json;

namespace {
std::string render(const std::string& t, const json& ctx = json::object()) { return ChatTemplate(t, "t").render(ctx); }
}  // namespace

TEST(ChatTemplate, TextExpressionsAndWhitespaceControl) {
  EXPECT_EQ(render("a{{ x }}b", {{"x", 1}}), "a1b");
  EXPECT_EQ(render("a {{- x -}} b", {{"x", "X"}}), "aXb");
  // trim_blocks: the newline after a block tag goes; lstrip_blocks: blanks before it on its line.
  EXPECT_EQ(render("{% if true %}\n  yes\n  {% endif %}\nend"), "  yes\nend");
  EXPECT_EQ(render("x {# comment #}y"), "x y");
  EXPECT_EQ(render("{{ none }}|{{ true }}|{{ 1.0 }}|{{ 7 // 2 }}|{{ 7 / 2 }}|{{ -7 % 3 }}|{{ 2 ** 10 }}"),
            "None|True|1.0|3|3.5|2|1024");
  EXPECT_EQ(render("{{ 'a' ~ 1 ~ none }}|{{ 'ab' * 2 }}|{{ [1, 2] + [3] }}|{{ {'k': 'v'} }}"), "a1None|abab|[1, 2, 3]|{'k': 'v'}");
  EXPECT_EQ(render("{{ undefined_name }}|{{ x.missing }}|{{ 'yes' if x else 'no' }}", {{"x", json::object()}}), "||no");
  // Unary minus of a computed value (the fuzzer found it read a destroyed temporary).
  EXPECT_EQ(render("{{ -(1 + 2) }}|{{ -x | abs }}|{{ --2.5 }}", {{"x", 4}}), "-3|4|2.5");
}

TEST(ChatTemplate, LoopsNamespacesMacrosAndFilters) {
  const json msgs = json::array({{{"role", "system"}, {"content", " S "}}, {{"role", "user"}, {"content", "U"}}});
  EXPECT_EQ(render("{% for m in messages %}{{ loop.index }}{{ m.role[0] }}{% if not loop.last %},{% endif %}{% endfor %}",
                   {{"messages", msgs}}),
            "1s,2u");
  EXPECT_EQ(render("{% for m in messages if m.role != 'system' %}{{ m['content'] }}{% else %}none{% endfor %}",
                   {{"messages", msgs}}),
            "U");
  EXPECT_EQ(render("{% set ns = namespace(n=0) %}{% for i in range(5) %}{% if i == 3 %}{% break %}{% endif %}"
                   "{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}"),
            "3");
  EXPECT_EQ(render("{% macro tag(x, y='!') %}<{{ x }}{{ y }}>{% endmacro %}{{ tag('a') }}{{ tag('b', y='?') }}"), "<a!><b?>");
  EXPECT_EQ(render("{{ messages[0].content | trim }}|{{ messages | length }}|{{ messages | map(attribute='role') | join('+') }}",
                   {{"messages", msgs}}),
            "S|2|system+user");
  EXPECT_EQ(render("{{ messages | selectattr('role', 'equalto', 'user') | list | length }}", {{"messages", msgs}}), "1");
  EXPECT_EQ(render("{{ x | tojson }}|{{ x | tojson(indent=2) }}", {{"x", {{"a", json::array({1, "é"})}}}}),
            "{\"a\": [1, \"é\"]}|{\n  \"a\": [\n    1,\n    \"é\"\n  ]\n}");
  EXPECT_EQ(render("{{ 'a,b'.split(',') }}|{{ ' x '.strip() }}|{{ 'Hi'.startswith('H') }}|{{ s[1:] }}|{{ s[::-1] }}",
                   {{"s", "abc"}}),
            "['a', 'b']|x|True|bc|cba");
  EXPECT_EQ(render("{% set x %}inner{% endset %}{{ x | upper }}|{{ d.items() | list }}", {{"d", {{"k", 1}}}}),
            "INNER|[['k', 1]]");
  EXPECT_EQ(render("{{ x is defined }}{{ y is none }}{{ 4 is divisibleby 2 }}{{ 'a' in 'cat' }}{{ 3 not in [1] }}",
                   {{"y", nullptr}}),
            "FalseTrueTrueTrueTrue");
}

TEST(ChatTemplate, ErrorsNameTheTemplateAndLine) {
  ts_test::expect_error([] { ChatTemplate("a\n{% if x %}", "tmpl").render(json::object()); }, "tmpl: the template ends inside a block");
  ts_test::expect_error([] { ChatTemplate("{{ x | nosuch }}", "tmpl").render(json{{"x", 1}}); }, "tmpl line 1: unknown filter 'nosuch'");
  ts_test::expect_error([] { ChatTemplate("\n{{ raise_exception('bad role') }}", "tmpl").render(json::object()); },
                        "tmpl line 2: raise_exception: bad role");
  ts_test::expect_error([] { ChatTemplate("{{ (", "tmpl"); }, "tmpl line 1");
  // Bounded: a loop that would render forever stops with an error, not a hang.
  ts_test::expect_error([] { ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "t").render(json::object()); },
                        "steps");
  std::string deep(500, '(');
  ts_test::expect_error([&] { ChatTemplate("{{ " + deep + " }}", "t"); }, "nested too deeply");
  // Python's integers are unbounded, ours 64 bits: a result past them is an error, not a wrapped
  // value (found by fuzzing: 22 * 3 ** 939).
  for (const char* t : {"{{ 9223372036854775807 + 1 }}", "{{ 22 * 3 ** 939 }}", "{{ -(-9223372036854775807 - 1) }}",
                        "{{ (-9223372036854775807 - 1) // -1 }}", "{{ [9223372036854775807, 1] | sum }}"}) {
    ts_test::expect_error([&] { ChatTemplate(t, "t").render(json::object()); }, "integer overflow");
  }
  EXPECT_EQ(ChatTemplate("{{ range(-9223372036854775807, 9223372036854775807, 9223372036854775807) | list }}", "t").render(json::object()),
            "[-9223372036854775807, 0]");
  EXPECT_EQ(ChatTemplate("{{ 2 ** 62 }}", "t").render(json::object()), "4611686018427387904");
}
