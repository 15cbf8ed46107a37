// The Jinja subset interpreter: expressions, statements, whitespace control and the
// errors it gives for what it does not support.
#include <gtest/gtest.h>

#include "core/error.h"
#include "tokenizer/chat_template.h"

using namespace spade;
using ojson = nlohmann::ordered_json;

namespace {

std::string R(const std::string& src, const ojson& ctx = ojson::object()) {
  ChatTemplate t(src, {{"bos_token", "<s>"}});
  return t.render_context(ctx);
}

TEST(Jinja, ExpressionsFollowPython) {
  EXPECT_EQ(R("{{ 1 + 2 * 3 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ 2 ** 10 }} {{ 7 / 2 }}"),
            "7 3 -4 1 1024 3.5");
  EXPECT_EQ(R("{{ 'a' ~ 1 ~ none }} {{ [1, 'x', none, true] }} {{ {'k': 1.0} }}"),
            "a1None [1, 'x', None, True] {'k': 1.0}");
  EXPECT_EQ(R("{{ 'abc'[::-1] }} {{ 'hello'[1:3] }} {{ [1,2,3,4][-2:] }} {{ 'x'[5] }}|"),
            "cba el [3, 4] |");
  EXPECT_EQ(R("{{ 'b' in 'abc' }} {{ 2 not in [1,2] }} {{ 'k' in {'k': 0} }}"), "True False True");
  EXPECT_EQ(R("{{ 'yes' if x else 'no' }} {{ 'a' if false }}|", {{"x", 0}}), "no |");
  EXPECT_EQ(R("{{ 1 < 2 and 'b' or 'c' }} {{ not 0 }}"), "b True");
  EXPECT_EQ(R("{{ 0.1 + 0.2 }} {{ 1e-5 }} {{ 1e20 }} {{ 3.0 }}"),
            "0.30000000000000004 1e-05 1e+20 3.0");
}

TEST(Jinja, StringMethodsAndFilters) {
  EXPECT_EQ(R("{{ '  x y  '.strip() }}|{{ 'xxhixx'.strip('x') }}|{{ '\\nA\\n'.lstrip('\\n') }}|"),
            "x y|hi|A\n|");
  EXPECT_EQ(R("{{ 'a</think>b'.split('</think>')[-1] }} {{ ' a  b '.split() }} {{ 'a,b,c'.split(',', 1) }}"),
            "b ['a', 'b'] ['a', 'b,c']");
  EXPECT_EQ(R("{{ 'Hi'.startswith('H') }} {{ 'Hi'.endswith(('x', 'i')) }} {{ 'ab'.upper() }} {{ 'a-b'.replace('-', '+') }}"),
            "True True AB a+b");
  EXPECT_EQ(R("{{ ' t '|trim }}|{{ [1,2,3]|length }}|{{ 'abc'|length }}|{{ [3,1,2]|sort|join(',') }}|{{ x|default('d') }}"),
            "t|3|3|1,2,3|d");
  EXPECT_EQ(R("{{ {'b': [1, 'é'], 'a': none}|tojson }}|{{ [1]|tojson(indent=2) }}"),
            "{\"b\": [1, \"é\"], \"a\": null}|[\n  1\n]");
  EXPECT_EQ(R("{{ msgs|selectattr('role', 'equalto', 'user')|map(attribute='c')|join(' ') }}",
              {{"msgs", ojson::parse(R"([{"role":"user","c":"a"},{"role":"x","c":"b"},{"role":"user","c":"c"}])")}}),
            "a c");
  EXPECT_EQ(R("{{ d.get('k', 5) }} {{ d.items()|list }} {{ d|length }}", {{"d", {{"z", 1}}}}),
            "5 [('z', 1)] 1");
}

TEST(Jinja, StatementsAndScopes) {
  EXPECT_EQ(R("{% for x in [1,2,3] if x != 2 %}{{ loop.index }}:{{ x }}{% if not loop.last %},{% endif %}{% endfor %}"),
            "1:1,2:3");
  EXPECT_EQ(R("{% set ns = namespace(n=0) %}{% for x in 'abc' %}{% set ns.n = ns.n + 1 %}{% set local = 1 %}{% endfor %}{{ ns.n }}{{ local is defined }}"),
            "3False");
  EXPECT_EQ(R("{% for x in [] %}a{% else %}empty{% endfor %}"), "empty");
  EXPECT_EQ(R("{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }};{% endfor %}"), "a=1;b=2;");
  EXPECT_EQ(R("{% for x in range(5) %}{% if x == 1 %}{% continue %}{% endif %}{% if x == 3 %}{% break %}{% endif %}{{ x }}{% endfor %}"),
            "02");
  EXPECT_EQ(R("{% macro hi(name, p='!') %}Hi {{ name }}{{ p }}{% endmacro %}{{ hi('a') }} {{ hi('b', p='?') }}"),
            "Hi a! Hi b?");
  EXPECT_EQ(R("{% set x %}inner {{ 1 }}{% endset %}[{{ x }}]"), "[inner 1]");
  EXPECT_EQ(R("{% if a %}A{% elif b %}B{% else %}C{% endif %}", {{"b", true}}), "B");
  EXPECT_EQ(R("{{ bos_token }}{# a comment #}{% raw %}{{ not rendered }}{% endraw %}"), "<s>{{ not rendered }}");
  EXPECT_EQ(R("{% generation %}gen{% endgeneration %}"), "gen");
}

TEST(Jinja, WhitespaceControlLikeTransformers) {
  // trim_blocks: the newline after a block tag goes; lstrip_blocks: indentation before it.
  EXPECT_EQ(R("{% if true %}\n  a\n  {% endif %}\nb\n"), "  a\nb");
  EXPECT_EQ(R("x  {%- if true -%}  y  {%- endif -%}  z"), "xyz");
  EXPECT_EQ(R("a\n    {%+ if true %}b{% endif %}"), "a\n    b");
  EXPECT_EQ(R("{{ 'v' }}\n{{- 'w' }}  {{- 'z' -}}\n!"), "vwz!");
  EXPECT_EQ(R("line\r\nnext\n"), "line\nnext");  // newlines normalized, one trailing dropped
}

TEST(Jinja, ErrorsAreClear) {
  auto err = [](const std::string& src) {
    try {
      R(src);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(err("{% include 'x' %}").find("unsupported statement '{% include %}'"), std::string::npos);
  EXPECT_NE(err("{{ x|frobnicate }}").find("unsupported filter 'frobnicate'"), std::string::npos);
  EXPECT_NE(err("{{ x is frob }}").find("unsupported test 'frob'"), std::string::npos);
  EXPECT_NE(err("{% if x %}").find("missing '{% endif %}'"), std::string::npos);
  EXPECT_NE(err("{{ raise_exception('bad role') }}").find("bad role"), std::string::npos);
  EXPECT_NE(err("{{ undefined_thing.attr }}").find("undefined"), std::string::npos);
  EXPECT_NE(err("{{ [1].append(2) }}").find("not allowed"), std::string::npos);
  EXPECT_NE(err("line1\n{{ 1 + }}").find("line 2"), std::string::npos);
  // A namespace must not hold itself, directly or through lists, dicts or another namespace
  // (a shared-pointer cycle would leak; found by fuzz_tokenizer_template).
  const char* self = "contains the namespace itself";
  EXPECT_NE(err("{% set ns = namespace(v=1) %}{% set ns.v = ns %}").find(self), std::string::npos);
  EXPECT_NE(err("{% set ns = namespace(v=1) %}{% set ns.v = [1, {'k': ns}] %}").find(self), std::string::npos);
  EXPECT_NE(err("{% set a = namespace(v=1) %}{% set b = namespace(w=a) %}{% set a.v = b %}").find(self),
            std::string::npos);
  EXPECT_EQ(R("{% set a = namespace(v=1) %}{% set b = namespace(w=a) %}{% set b.w = [a, a] %}{{ b.w[1].v }}"), "1");
}

}  // namespace
