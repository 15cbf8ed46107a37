// libFuzzer target for the OpenAI request parser (src/server/openai_request.h): arbitrary
// bytes as the body of /v1/completions, /v1/chat/completions, /tokenize and /detokenize.
// The parser must never crash, hang or throw; what it accepts must satisfy the documented
// limits, and every error and response it leads to must render as valid JSON.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include <nlohmann/json.hpp>

#include "server/openai_request.h"
#include "server/openai_response.h"

using namespace spade::server;

static void require(bool ok) {
  if (!ok) std::abort();
}

static void check_json(const std::string& s) {
  require(nlohmann::json::accept(s));
}

static void check_request(const ParseResult& r) {
  if (!r.ok()) {
    require(r.error.status == 400 || r.error.status == 413);
    require(!r.error.message.empty());
    check_json(error_json(r.error));
    return;
  }
  const ApiRequest& a = *r.request;
  require(!a.max_tokens || (*a.max_tokens >= (a.echo ? 0 : 1) && *a.max_tokens <= kMaxTokensLimit));
  require(a.n >= 1 && a.n <= kMaxChoices);
  require(a.prompt_logprobs >= -1 && a.prompt_logprobs <= kMaxLogprobs);
  require(a.temperature >= 0 && a.temperature <= 2);
  require(a.top_p > 0 && a.top_p <= 1);
  require(a.logprobs >= -1 && a.logprobs <= kMaxLogprobs);
  require(a.stop.size() <= size_t(kMaxStopStrings));
  for (const auto& s : a.stop) require(!s.empty() && s.size() <= kMaxStopBytes && valid_utf8(s));
  for (int32_t id : a.prompt_ids) require(id >= 0);
  require(!a.prompt_is_ids || !a.prompt_ids.empty());
  require(valid_utf8(a.prompt));
  for (const auto& m : a.messages) require(!m.role.empty() && valid_utf8(m.content));
  if (a.kind == ApiKind::Chat) require(!a.messages.empty());
  if (a.sparse) require(!a.sparse->method.empty());
  // The text it carries can be echoed back in a response: always valid JSON.
  ResponseMeta m;
  m.kind = a.kind;
  m.id = "x";
  m.model = a.model;
  const std::string text = a.kind == ApiKind::Chat ? a.messages[0].content : a.prompt;
  check_json(full_response(m, text, {}, spade::FinishReason::Stop, 1, 1));
  const std::string c = stream_chunk(m, text, {}, "stop", true, 0);
  check_json(c.substr(6));
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  check_request(parse_completion_request(body));
  check_request(parse_chat_request(body));
  ApiError err;
  if (!parse_tokenize_request(body, err)) check_json(error_json(err));
  if (!parse_detokenize_request(body, err)) check_json(error_json(err));
  return 0;
}
