#include "server/openai_response.h"

#include <nlohmann/json.hpp>

namespace spade::server {

using json = nlohmann::json;

namespace {

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

json bytes_of(const std::string& s) {
  json b = json::array();
  for (unsigned char c : s) b.push_back(int(c));
  return b;
}

std::string piece(const ResponseMeta& m, int32_t id) { return m.text ? m.text->piece(id) : std::string(); }

// Completions: {"tokens", "token_logprobs", "top_logprobs", "text_offset"}.
json completion_logprobs(const ResponseMeta& m, const std::vector<TokenLogprob>& lps,
                         size_t offset) {
  json tokens = json::array(), lp = json::array(), top = json::array(), off = json::array();
  for (const TokenLogprob& t : lps) {
    const std::string p = piece(m, t.id);
    tokens.push_back(p);
    lp.push_back(t.logprob);
    json alt = json::object();
    for (const auto& [id, l] : t.top) alt[piece(m, id)] = l;
    top.push_back(std::move(alt));
    off.push_back(offset);
    offset += p.size();
  }
  return {{"tokens", tokens}, {"token_logprobs", lp}, {"top_logprobs", top}, {"text_offset", off}};
}

// Chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}.
json chat_logprobs(const ResponseMeta& m, const std::vector<TokenLogprob>& lps) {
  json content = json::array();
  for (const TokenLogprob& t : lps) {
    const std::string p = piece(m, t.id);
    json alts = json::array();
    for (const auto& [id, l] : t.top) {
      const std::string q = piece(m, id);
      alts.push_back({{"token", q}, {"logprob", l}, {"bytes", bytes_of(q)}});
    }
    content.push_back({{"token", p}, {"logprob", t.logprob}, {"bytes", bytes_of(p)}, {"top_logprobs", alts}});
  }
  return {{"content", content}};
}

json usage(int64_t p, int64_t c) {
  return {{"prompt_tokens", p}, {"completion_tokens", c}, {"total_tokens", p + c}};
}

json envelope(const ResponseMeta& m, bool chunk) {
  const char* object = m.kind == ApiKind::Chat ? (chunk ? "chat.completion.chunk" : "chat.completion")
                                               : "text_completion";
  return {{"id", m.id}, {"object", object}, {"created", m.created}, {"model", m.model}};
}

}  // namespace

const char* api_finish_reason(FinishReason r) {
  return r == FinishReason::Length ? "length" : "stop";
}

std::string full_response(const ResponseMeta& m, const std::string& text,
                          const std::vector<TokenLogprob>& logprobs, FinishReason reason,
                          int64_t prompt_tokens, int64_t completion_tokens) {
  json j = envelope(m, false);
  json choice = {{"index", 0}};
  if (m.kind == ApiKind::Chat) {
    choice["message"] = {{"role", "assistant"}, {"content", text}};
    choice["logprobs"] = m.logprobs >= 0 ? chat_logprobs(m, logprobs) : json(nullptr);
  } else {
    choice["text"] = text;
    choice["logprobs"] = m.logprobs >= 0 ? completion_logprobs(m, logprobs, 0) : json(nullptr);
  }
  choice["finish_reason"] = api_finish_reason(reason);
  j["choices"] = json::array({choice});
  j["usage"] = usage(prompt_tokens, completion_tokens);
  return dump(j);
}

std::string stream_chunk(const ResponseMeta& m, const std::string& delta,
                         const std::vector<TokenLogprob>& logprobs, const char* reason,
                         bool role_header, size_t text_offset) {
  json j = envelope(m, true);
  json choice = {{"index", 0}};
  if (m.kind == ApiKind::Chat) {
    json d = json::object();
    if (role_header) d["role"] = "assistant";
    if (!delta.empty() || role_header) d["content"] = delta;
    choice["delta"] = std::move(d);
    choice["logprobs"] = m.logprobs >= 0 && !logprobs.empty() ? chat_logprobs(m, logprobs) : json(nullptr);
  } else {
    choice["text"] = delta;
    choice["logprobs"] = m.logprobs >= 0 && !logprobs.empty()
                             ? completion_logprobs(m, logprobs, text_offset)
                             : json(nullptr);
  }
  choice["finish_reason"] = reason ? json(reason) : json(nullptr);
  j["choices"] = json::array({choice});
  return "data: " + dump(j) + "\n\n";
}

std::string usage_chunk(const ResponseMeta& m, int64_t prompt_tokens, int64_t completion_tokens) {
  json j = envelope(m, true);
  j["choices"] = json::array();
  j["usage"] = usage(prompt_tokens, completion_tokens);
  return "data: " + dump(j) + "\n\n";
}

std::string stream_error(const ApiError& e) { return "data: " + error_json(e) + "\n\n"; }

}  // namespace spade::server
