// OpenAI request parsing and validation (src/server/openai_request.h): what is accepted,
// and that every kind of malformed input becomes a 400 naming the field, never a crash.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "server/openai_request.h"
#include "server/openai_response.h"

using namespace spade;
using namespace spade::server;

namespace {

ApiRequest ok_completion(const std::string& body) {
  ParseResult r = parse_completion_request(body);
  EXPECT_TRUE(r.ok()) << body << " -> " << r.error.message;
  return r.ok() ? *r.request : ApiRequest{};
}
ApiRequest ok_chat(const std::string& body) {
  ParseResult r = parse_chat_request(body);
  EXPECT_TRUE(r.ok()) << body << " -> " << r.error.message;
  return r.ok() ? *r.request : ApiRequest{};
}
ApiError bad_completion(const std::string& body) {
  ParseResult r = parse_completion_request(body);
  EXPECT_FALSE(r.ok()) << body;
  EXPECT_EQ(r.error.status, 400) << body;
  EXPECT_FALSE(r.error.message.empty());
  return r.error;
}
ApiError bad_chat(const std::string& body) {
  ParseResult r = parse_chat_request(body);
  EXPECT_FALSE(r.ok()) << body;
  EXPECT_EQ(r.error.status, 400) << body;
  return r.error;
}

}  // namespace

TEST(ServerRequest, CompletionDefaultsAndFields) {
  ApiRequest r = ok_completion(R"({"model": "m", "prompt": "Hello"})");
  EXPECT_EQ(r.kind, ApiKind::Completion);
  EXPECT_EQ(r.prompt, "Hello");
  EXPECT_FALSE(r.prompt_is_ids);
  EXPECT_FALSE(r.max_tokens.has_value());
  EXPECT_DOUBLE_EQ(r.temperature, 1.0);
  EXPECT_FALSE(r.stream);
  EXPECT_EQ(r.logprobs, -1);
  EXPECT_FALSE(r.sparse.has_value());

  r = ok_completion(R"({"prompt": "x", "max_tokens": 7, "temperature": 0, "top_p": 0.5,
      "top_k": 40, "min_p": 0.1, "repetition_penalty": 1.2, "seed": -3, "stop": ["a", "bc"],
      "stream": true, "stream_options": {"include_usage": true}, "logprobs": 2, "n": 1,
      "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "user": "u",
      "ignore_eos": true, "stop_token_ids": [2, 3], "unknown_field": {"x": [1, 2]}})");
  EXPECT_EQ(*r.max_tokens, 7);
  EXPECT_DOUBLE_EQ(r.temperature, 0.0);
  EXPECT_DOUBLE_EQ(r.top_p, 0.5);
  EXPECT_EQ(r.top_k, 40);
  EXPECT_DOUBLE_EQ(r.min_p, 0.1);
  EXPECT_DOUBLE_EQ(r.repetition_penalty, 1.2);
  EXPECT_EQ(*r.seed, uint64_t(int64_t(-3)));
  EXPECT_EQ(r.stop, (std::vector<std::string>{"a", "bc"}));
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
  EXPECT_EQ(r.logprobs, 2);
  EXPECT_TRUE(r.ignore_eos);
  EXPECT_EQ(r.stop_token_ids, (std::vector<int32_t>{2, 3}));

  // null means "unset" (OpenAI clients send it).
  r = ok_completion(R"({"prompt": "x", "max_tokens": null, "stop": null, "seed": null})");
  EXPECT_FALSE(r.max_tokens.has_value());
  EXPECT_TRUE(r.stop.empty());
  EXPECT_EQ(ok_completion(R"({"prompt": "x", "stop": "END"})").stop, std::vector<std::string>{"END"});
  EXPECT_EQ(*ok_completion(R"({"prompt": "x", "max_tokens": 5.0})").max_tokens, 5);
  EXPECT_EQ(*ok_completion(R"({"prompt": "x", "seed": 18446744073709551615})").seed, UINT64_MAX);
}

TEST(ServerRequest, PromptForms) {
  EXPECT_EQ(ok_completion(R"({"prompt": ["one"]})").prompt, "one");
  ApiRequest r = ok_completion(R"({"prompt": [1, 2, 3]})");
  EXPECT_TRUE(r.prompt_is_ids);
  EXPECT_EQ(r.prompt_ids, (std::vector<int32_t>{1, 2, 3}));
  r = ok_completion(R"({"prompt": [[5, 6]]})");
  EXPECT_EQ(r.prompt_ids, (std::vector<int32_t>{5, 6}));
  EXPECT_EQ(ok_completion(R"({"prompt": ""})").prompt, "");
  EXPECT_EQ(bad_completion(R"({"prompt": ["a", "b"]})").code, "unsupported_value");
  bad_completion(R"({"prompt": [[1], [2]]})");
  bad_completion(R"({"prompt": []})");
  bad_completion(R"({"prompt": [[]]})");
  bad_completion(R"({"prompt": [1, "a"]})");
  bad_completion(R"({"prompt": [-1]})");
  bad_completion(R"({"prompt": [4294967296]})");
  bad_completion(R"({"prompt": [1.5]})");
  bad_completion(R"({"prompt": 5})");
  bad_completion(R"({"prompt": {"a": 1}})");
  EXPECT_EQ(bad_completion(R"({"max_tokens": 5})").param, "prompt");
}

TEST(ServerRequest, ChatMessages) {
  ApiRequest r = ok_chat(R"({"model": "m", "messages": [
      {"role": "system", "content": "Be brief."},
      {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
      {"role": "assistant", "content": null}],
      "max_completion_tokens": 9, "logprobs": true, "top_logprobs": 3})");
  ASSERT_EQ(r.messages.size(), 3u);
  EXPECT_EQ(r.messages[0].role, "system");
  EXPECT_EQ(r.messages[1].content, "Hi there");
  EXPECT_EQ(r.messages[2].content, "");
  EXPECT_EQ(*r.max_tokens, 9);
  EXPECT_EQ(r.logprobs, 3);
  EXPECT_EQ(ok_chat(R"({"messages": [{"role": "user", "content": "x"}], "logprobs": true})").logprobs, 0);
  EXPECT_EQ(ok_chat(R"({"messages": [{"role": "user", "content": "x"}], "max_tokens": 4})").max_tokens, 4);

  EXPECT_EQ(bad_chat(R"({"model": "m"})").code, "missing_required_parameter");
  bad_chat(R"({"messages": []})");
  bad_chat(R"({"messages": "hi"})");
  bad_chat(R"({"messages": [1]})");
  bad_chat(R"({"messages": [{"content": "no role"}]})");
  bad_chat(R"({"messages": [{"role": 5, "content": "x"}]})");
  bad_chat(R"({"messages": [{"role": "", "content": "x"}]})");
  bad_chat(R"({"messages": [{"role": "user", "content": 5}]})");
  bad_chat(R"({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})");
  bad_chat(R"({"messages": [{"role": "user", "content": [{"type": "text"}]}]})");
  bad_chat(R"({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})");
  bad_chat(R"({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]})");
  bad_chat(R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}})");
}

TEST(ServerRequest, WrongTypesAndRanges) {
  const char* cases[] = {
      R"({"prompt": "x", "max_tokens": "5"})",     R"({"prompt": "x", "max_tokens": 0})",
      R"({"prompt": "x", "max_tokens": -1})",      R"({"prompt": "x", "max_tokens": 2.5})",
      R"({"prompt": "x", "max_tokens": 1e300})",   R"({"prompt": "x", "max_tokens": 99999999999999999999999})",
      R"({"prompt": "x", "max_tokens": true})",    R"({"prompt": "x", "temperature": "hot"})",
      R"({"prompt": "x", "temperature": -0.1})",   R"({"prompt": "x", "temperature": 1e300})",
      R"({"prompt": "x", "top_p": 0})",            R"({"prompt": "x", "top_p": 1.5})",
      R"({"prompt": "x", "top_k": -2})",           R"({"prompt": "x", "top_k": 1.5})",
      R"({"prompt": "x", "min_p": 2})",            R"({"prompt": "x", "repetition_penalty": 0})",
      R"({"prompt": "x", "seed": "abc"})",         R"({"prompt": "x", "seed": 1.5})",
      R"({"prompt": "x", "stop": 5})",             R"({"prompt": "x", "stop": [""]})",
      R"({"prompt": "x", "stop": [1]})",           R"({"prompt": "x", "stream": "yes"})",
      R"({"prompt": "x", "stream_options": 1})",   R"({"prompt": "x", "n": 0})",
      R"({"prompt": "x", "n": 17})",               R"({"prompt": "x", "n": -1})",
      R"({"prompt": "x", "n": 1.5})",              R"({"prompt": "x", "n": "2"})",
      R"({"prompt": "x", "best_of": 3})",          R"({"prompt": "x", "n": 2, "best_of": 3})",          R"({"prompt": "x", "presence_penalty": 0.5})",
      R"({"prompt": "x", "frequency_penalty": 9})", R"({"prompt": "x", "logit_bias": {"1": 5}})",
      R"({"prompt": "x", "logprobs": 21})",        R"({"prompt": "x", "logprobs": true})",
      R"({"prompt": "x", "max_tokens": 0, "logprobs": 1})", R"({"prompt": "x", "suffix": "s"})",
      R"({"prompt": "x", "echo": "yes"})",         R"({"prompt": "x", "echo": false, "max_tokens": 0})",
      R"({"prompt": "x", "prompt_logprobs": 21})", R"({"prompt": "x", "prompt_logprobs": -1})",
      R"({"prompt": "x", "prompt_logprobs": true})",
      R"({"prompt": "x", "model": 5})",            R"({"prompt": "x", "ignore_eos": 1})",
      R"({"prompt": "x", "stop_token_ids": [-5]})", R"({"prompt": "x", "stop_token_ids": 3})",
  };
  for (const char* c : cases) {
    ApiError e = bad_completion(c);
    EXPECT_FALSE(e.param.empty()) << c;
  }
  std::string many = R"({"prompt": "x", "stop": [)";
  for (int i = 0; i < 17; ++i) many += std::string(i ? "," : "") + "\"s" + std::to_string(i) + "\"";
  bad_completion(many + "]}");
  bad_completion(R"({"prompt": "x", "stop": [")" + std::string(300, 'a') + "\"]}");
}

TEST(ServerRequest, ChoicesEchoAndPromptLogprobs) {
  EXPECT_EQ(ok_completion(R"({"prompt": "x"})").n, 1);
  EXPECT_EQ(ok_completion(R"({"prompt": "x", "n": 3})").n, 3);
  EXPECT_EQ(ok_completion(R"({"prompt": "x", "n": 16, "best_of": 16})").n, 16);
  EXPECT_EQ(ok_chat(R"({"messages": [{"role": "user", "content": "x"}], "n": 2})").n, 2);
  EXPECT_EQ(bad_completion(R"({"prompt": "x", "n": 0})").param, "n");
  EXPECT_EQ(bad_chat(R"({"messages": [{"role": "user", "content": "x"}], "n": 17})").param, "n");
  // lm-eval-harness's loglikelihood request: the prompt's scores, nothing generated.
  ApiRequest r = ok_completion(R"({"prompt": [[1, 2, 3]], "echo": true, "logprobs": 5, "max_tokens": 0})");
  EXPECT_TRUE(r.echo);
  EXPECT_EQ(r.logprobs, 5);
  EXPECT_EQ(*r.max_tokens, 0);
  EXPECT_EQ(r.prompt_ids, (std::vector<int32_t>{1, 2, 3}));
  r = ok_completion(R"({"prompt": "x", "echo": true, "logprobs": 0, "max_tokens": 4, "prompt_logprobs": 2})");
  EXPECT_EQ(*r.max_tokens, 4);
  EXPECT_EQ(r.prompt_logprobs, 2);
  EXPECT_EQ(ok_completion(R"({"prompt": "x"})").prompt_logprobs, -1);
  EXPECT_EQ(bad_completion(R"({"prompt": "x", "max_tokens": 0})").param, "max_tokens");
  // echo and prompt_logprobs belong to /v1/completions.
  EXPECT_EQ(bad_chat(R"({"messages": [{"role": "user", "content": "x"}], "echo": true})").param, "echo");
  EXPECT_EQ(bad_chat(R"({"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1})").param,
            "prompt_logprobs");
  ok_chat(R"({"messages": [{"role": "user", "content": "x"}], "echo": false})");
}

TEST(ServerRequest, MalformedBodies) {
  const std::string cases[] = {
      "", " ", "null", "[]", "\"str\"", "42", "{", "{\"prompt\": \"x\"", "{\"prompt\": \"x\",}",
      "{'prompt': 'x'}", "{\"prompt\": \"x\"} trailing", "{\"prompt\": \"\\ud800\"}",
      "{\"prompt\": \"\xff\xfe\"}", std::string("{\"prompt\": \"a\0b\"}", 17),
      "{\"prompt\": \"\xc0\xaf\"}", "{\"prompt\": \"\xed\xa0\x80\"}", "{\"prompt\": NaN}",
      "{\"prompt\": \"x\", \"max_tokens\": Infinity}", "\xef\xbb\xbf{}",
      "{\"prompt\": \"x\", \"temperature\": 1e309}",
  };
  for (const std::string& c : cases) {
    ParseResult r = parse_completion_request(c);
    EXPECT_FALSE(r.ok()) << c;
    EXPECT_EQ(r.error.status, 400);
    // The error renders as valid JSON even when the input was not UTF-8.
    auto j = nlohmann::json::parse(error_json(r.error));
    EXPECT_TRUE(j["error"]["message"].is_string());
    EXPECT_EQ(j["error"]["type"], "invalid_request_error");
  }
}

TEST(ServerRequest, DeepNestingIsRefusedQuickly) {
  std::string deep = "{\"prompt\": \"x\", \"extra\": " + std::string(100000, '[') + std::string(100000, ']') + "}";
  ApiError e = bad_completion(deep);
  EXPECT_EQ(e.code, "invalid_json");
  std::string ok = "{\"prompt\": \"x\", \"extra\": " + std::string(30, '[') + std::string(30, ']') + "}";
  ok_completion(ok);
  // Brackets inside strings do not count.
  ok_completion("{\"prompt\": \"" + std::string(1000, '[') + "\"}");
}

TEST(ServerRequest, SparseExtension) {
  ApiRequest r = ok_completion(R"({"prompt": "x", "sparse": {"method": "quest", "budget": 1024,
      "page_size": 16, "ratio": 0.25, "layers": [1, 2], "flag": true, "options": {"k": "v"}}})");
  ASSERT_TRUE(r.sparse.has_value());
  EXPECT_EQ(r.sparse->method, "quest");
  std::map<std::string, std::string> o(r.sparse->options.begin(), r.sparse->options.end());
  EXPECT_EQ(o["budget"], "1024");
  EXPECT_EQ(o["ratio"], "0.25");
  EXPECT_EQ(o["layers"], "1,2");
  EXPECT_EQ(o["flag"], "1");
  EXPECT_EQ(o["k"], "v");
  EXPECT_EQ(ok_completion(R"({"prompt": "x", "sparse": "streaming"})").sparse->method, "streaming");
  {  // the CLI's string form, stacks included
    const ApiRequest q = ok_completion(R"({"prompt": "x", "sparse": "quest+blasst:budget=256,a=2"})");
    ASSERT_TRUE(q.sparse.has_value());
    EXPECT_EQ(q.sparse->method, "quest+blasst");
    std::map<std::string, std::string> o(q.sparse->options.begin(), q.sparse->options.end());
    EXPECT_EQ(o.size(), 2u);
    EXPECT_EQ(o["budget"], "256");
    EXPECT_EQ(o["a"], "2");
    EXPECT_EQ(ok_completion(R"({"prompt": "x", "sparse": {"method": "quest+twilight"}})").sparse->method,
              "quest+twilight");
  }
  EXPECT_FALSE(ok_completion(R"({"prompt": "x", "sparse": null})").sparse.has_value());
  for (const char* c : {R"({"prompt": "x", "sparse": 5})", R"({"prompt": "x", "sparse": {}})",
                        R"({"prompt": "x", "sparse": {"method": 1}})",
                        R"({"prompt": "x", "sparse": {"method": "a b"}})",
                        R"({"prompt": "x", "sparse": "quest:budget"})",
                        R"({"prompt": "x", "sparse": "a b:budget=2"})",
                        R"({"prompt": "x", "sparse": {"method": "q", "budget": {"x": 1}}})",
                        R"({"prompt": "x", "sparse": {"method": "q", "l": ["a"]}})",
                        R"({"prompt": "x", "sparse": {"method": "q", "options": 3}})"})
    EXPECT_EQ(bad_completion(c).param, "sparse") << c;
}

TEST(ServerRequest, TokenizeAndDetokenize) {
  ApiError err;
  auto t = parse_tokenize_request(R"({"prompt": "hi", "add_special_tokens": false})", err);
  ASSERT_TRUE(t);
  EXPECT_EQ(t->prompt, "hi");
  EXPECT_FALSE(t->add_special_tokens);
  t = parse_tokenize_request(R"({"messages": [{"role": "user", "content": "x"}]})", err);
  ASSERT_TRUE(t);
  EXPECT_TRUE(t->is_chat);
  EXPECT_FALSE(parse_tokenize_request(R"({"prompt": 3})", err));
  EXPECT_EQ(err.param, "prompt");
  EXPECT_FALSE(parse_tokenize_request("{", err));
  auto d = parse_detokenize_request(R"({"tokens": [1, 2]})", err);
  ASSERT_TRUE(d);
  EXPECT_EQ(d->tokens, (std::vector<int32_t>{1, 2}));
  EXPECT_FALSE(parse_detokenize_request(R"({"tokens": [1, -2]})", err));
  EXPECT_FALSE(parse_detokenize_request(R"({"tokens": "12"})", err));
  EXPECT_FALSE(parse_detokenize_request(R"({})", err));
}

TEST(ServerRequest, Utf8Validation) {
  EXPECT_TRUE(valid_utf8("plain ascii"));
  EXPECT_TRUE(valid_utf8("\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80"));
  EXPECT_FALSE(valid_utf8("\xc3"));
  EXPECT_FALSE(valid_utf8("\xe2\x82"));
  EXPECT_FALSE(valid_utf8("\xc0\xaf"));          // overlong
  EXPECT_FALSE(valid_utf8("\xed\xa0\x80"));      // surrogate
  EXPECT_FALSE(valid_utf8("\xf4\x90\x80\x80"));  // > U+10FFFF
  EXPECT_FALSE(valid_utf8("\xff"));
}

TEST(ServerResponse, ChunksAndBodiesAreOpenAIShaped) {
  ResponseMeta m;
  m.kind = ApiKind::Chat;
  m.id = "chatcmpl-1";
  m.created = 5;
  m.model = "tiny";
  std::string c = stream_chunk(m, "h\xc3\xa9", {}, nullptr, true, 0);
  ASSERT_EQ(c.rfind("data: ", 0), 0u);
  ASSERT_EQ(c.substr(c.size() - 2), "\n\n");
  auto j = nlohmann::json::parse(c.substr(6));
  EXPECT_EQ(j["object"], "chat.completion.chunk");
  EXPECT_EQ(j["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(j["choices"][0]["delta"]["content"], "h\xc3\xa9");
  EXPECT_TRUE(j["choices"][0]["finish_reason"].is_null());
  j = nlohmann::json::parse(stream_chunk(m, "", {}, "length", false, 0).substr(6));
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_TRUE(j["choices"][0]["delta"].empty());
  j = nlohmann::json::parse(usage_chunk(m, 3, 4).substr(6));
  EXPECT_TRUE(j["choices"].empty());
  EXPECT_EQ(j["usage"]["total_tokens"], 7);
  // usage.sparse: full by default, density null without decode steps
  EXPECT_EQ(j["usage"]["sparse"]["method"], "full");
  EXPECT_TRUE(j["usage"]["sparse"]["options"].empty());
  EXPECT_TRUE(j["usage"]["sparse"]["density"].is_null());
  {
    ResponseMeta q = m;
    q.sparse_method = "quest";
    q.sparse_options = {{"budget", "256"}};
    q.sparse_description = "quest budget=256 page=16";
    q.density = 0.25;
    auto u = nlohmann::json::parse(usage_chunk(q, 3, 4).substr(6))["usage"]["sparse"];
    EXPECT_EQ(u["method"], "quest");
    EXPECT_EQ(u["options"]["budget"], "256");
    EXPECT_EQ(u["description"], "quest budget=256 page=16");
    EXPECT_DOUBLE_EQ(u["density"].get<double>(), 0.25);
  }
  j = nlohmann::json::parse(full_response(m, "ok", {}, FinishReason::Stop, 3, 1));
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["choices"][0]["message"]["content"], "ok");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");

  m.kind = ApiKind::Completion;
  m.logprobs = 1;
  TokenLogprob lp;
  lp.id = 3;
  lp.logprob = -0.5f;
  lp.top = {{3, -0.5f}};
  j = nlohmann::json::parse(full_response(m, "abc", {lp}, FinishReason::Length, 1, 1));
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["choices"][0]["text"], "abc");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_DOUBLE_EQ(j["choices"][0]["logprobs"]["token_logprobs"][0].get<double>(), -0.5);
  EXPECT_EQ(j["choices"][0]["logprobs"]["text_offset"][0], 0);
  // Invalid UTF-8 from a partial token never breaks the JSON.
  j = nlohmann::json::parse(full_response(m, "\xe2\x82", {}, FinishReason::Stop, 1, 1));
  EXPECT_TRUE(j["choices"][0]["text"].is_string());
}

TEST(ServerResponse, ChoicesEchoedLogprobsAndPromptLogprobs) {
  // Pieces: id -> "<id>".
  struct IdText : TokenText {
    std::unique_ptr<TextStream> stream(int32_t) const override { return nullptr; }
    std::string piece(int32_t id) const override { return "<" + std::to_string(id) + ">"; }
  } text;
  ResponseMeta m;
  m.kind = ApiKind::Completion;
  m.id = "cmpl-1";
  m.model = "tiny";
  m.logprobs = 1;
  m.text = &text;
  PromptScores ps;
  ps.ids = {5, 6, 7};
  ps.offsets = {0, 3, 6};
  ps.echo_top = 1;
  ps.prompt_top = 2;
  TokenLogprob s1, s2, g;
  s1.id = 6, s1.logprob = -1.5f, s1.rank = 3, s1.top = {{9, -0.25f}, {8, -1.f}};
  s2.id = 7, s2.logprob = -0.5f, s2.rank = 1, s2.top = {{7, -0.5f}, {4, -2.f}};
  g.id = 2, g.logprob = -0.75f, g.top = {{2, -0.75f}};
  ps.scores = {s1, s2};
  std::vector<TokenLogprob> gen{g};
  std::vector<ChoiceOut> cs(2);
  for (int i = 0; i < 2; ++i) {
    cs[size_t(i)].index = i;
    cs[size_t(i)].text = "<5><6><7><2>";
    cs[size_t(i)].logprobs = &gen;
    cs[size_t(i)].text_offset = 9;
    cs[size_t(i)].prompt = &ps;
    cs[size_t(i)].finish_reason = "length";
  }
  auto j = nlohmann::json::parse(full_response(m, cs, 3, 2));
  ASSERT_EQ(j["choices"].size(), 2u);
  EXPECT_EQ(j["choices"][1]["index"], 1);
  EXPECT_EQ(j["usage"]["prompt_tokens"], 3);
  EXPECT_EQ(j["usage"]["completion_tokens"], 2);
  EXPECT_EQ(j["usage"]["total_tokens"], 5);
  const auto& lp = j["choices"][0]["logprobs"];
  EXPECT_EQ(lp["tokens"], nlohmann::json({"<5>", "<6>", "<7>", "<2>"}));
  EXPECT_TRUE(lp["token_logprobs"][0].is_null());
  EXPECT_TRUE(lp["top_logprobs"][0].is_null());
  EXPECT_DOUBLE_EQ(lp["token_logprobs"][1].get<double>(), -1.5);
  EXPECT_DOUBLE_EQ(lp["token_logprobs"][3].get<double>(), -0.75);
  EXPECT_EQ(lp["top_logprobs"][1].size(), 1u);  // echo_top = 1 of the two computed
  EXPECT_DOUBLE_EQ(lp["top_logprobs"][1]["<9>"].get<double>(), -0.25);
  EXPECT_EQ(lp["text_offset"], nlohmann::json({0, 3, 6, 9}));
  const auto& pl = j["choices"][0]["prompt_logprobs"];
  ASSERT_EQ(pl.size(), 3u);
  EXPECT_TRUE(pl[0].is_null());
  EXPECT_EQ(pl[1].size(), 3u);  // the prompt token and the top 2
  EXPECT_DOUBLE_EQ(pl[1]["6"]["logprob"].get<double>(), -1.5);
  EXPECT_EQ(pl[1]["6"]["rank"], 3);
  EXPECT_EQ(pl[1]["6"]["decoded_token"], "<6>");
  EXPECT_EQ(pl[1]["9"]["rank"], 1);
  EXPECT_EQ(pl[2].size(), 2u);  // the prompt token is the best: listed once
  EXPECT_EQ(pl[2]["7"]["rank"], 1);
  // A stream chunk carries its choice's index; the opening one the prompt's scores.
  ChoiceOut o;
  o.index = 2;
  o.text = "<5><6><7>";
  o.prompt = &ps;
  j = nlohmann::json::parse(stream_chunk(m, o).substr(6));
  EXPECT_EQ(j["choices"][0]["index"], 2);
  EXPECT_EQ(j["choices"][0]["logprobs"]["tokens"].size(), 3u);
  EXPECT_EQ(j["choices"][0]["prompt_logprobs"].size(), 3u);
  // Without prompt scores: no prompt_logprobs field.
  j = nlohmann::json::parse(full_response(m, "abc", {}, FinishReason::Stop, 1, 1));
  EXPECT_FALSE(j["choices"][0].contains("prompt_logprobs"));
}
