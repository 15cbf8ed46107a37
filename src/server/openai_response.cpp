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

// Completions: {"tokens", "token_logprobs", "top_logprobs", "text_offset"}; an echoed
// prompt (`ps` with echo_top >= 0) opens them, its first token with null logprobs.
json completion_logprobs(const ResponseMeta& m, const PromptScores* ps,
                         const std::vector<TokenLogprob>& lps, size_t offset) {
  json tokens = json::array(), lp = json::array(), top = json::array(), off = json::array();
  if (ps && ps->echo_top >= 0) {
    for (size_t i = 0; i < ps->ids.size(); ++i) {
      tokens.push_back(piece(m, ps->ids[i]));
      off.push_back(i < ps->offsets.size() ? ps->offsets[i] : 0);
      if (i == 0 || i - 1 >= ps->scores.size()) {
        lp.push_back(nullptr);
        top.push_back(nullptr);
        continue;
      }
      const TokenLogprob& t = ps->scores[i - 1];
      lp.push_back(t.logprob);
      json alt = json::object();
      for (size_t k = 0; k < t.top.size() && k < size_t(ps->echo_top); ++k)
        alt[piece(m, t.top[k].first)] = t.top[k].second;
      top.push_back(std::move(alt));
    }
  }
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

// vLLM's prompt_logprobs: [null, {"<id>": {"logprob", "rank", "decoded_token"}, ...}, ...],
// each entry holding the prompt token and the top alternatives.
json prompt_logprobs_json(const ResponseMeta& m, const PromptScores& ps) {
  json out = json::array();
  for (size_t i = 0; i < ps.ids.size(); ++i) {
    if (i == 0 || i - 1 >= ps.scores.size()) {
      out.push_back(nullptr);
      continue;
    }
    const TokenLogprob& t = ps.scores[i - 1];
    json d = json::object();
    d[std::to_string(t.id)] = {{"logprob", t.logprob}, {"rank", t.rank}, {"decoded_token", piece(m, t.id)}};
    for (size_t k = 0; k < t.top.size() && k < size_t(std::max(ps.prompt_top, 0)); ++k) {
      const std::string key = std::to_string(t.top[k].first);
      if (!d.contains(key))
        d[key] = {{"logprob", t.top[k].second}, {"rank", k + 1}, {"decoded_token", piece(m, t.top[k].first)}};
    }
    out.push_back(std::move(d));
  }
  return out;
}

const std::vector<TokenLogprob>& none() {
  static const std::vector<TokenLogprob> empty;
  return empty;
}

json usage(const ResponseMeta& m, int64_t p, int64_t c) {
  json opts = json::object();
  for (const auto& [k, v] : m.sparse_options) opts[k] = v;
  json sparse = {{"method", m.sparse_method},
                 {"options", std::move(opts)},
                 {"description", m.sparse_description.empty() ? m.sparse_method : m.sparse_description},
                 {"density", m.density >= 0 ? json(m.density) : json(nullptr)}};
  return {{"prompt_tokens", p}, {"completion_tokens", c}, {"total_tokens", p + c},
          {"sparse", std::move(sparse)}};
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

std::string full_response(const ResponseMeta& m, const std::vector<ChoiceOut>& choices,
                          int64_t prompt_tokens, int64_t completion_tokens) {
  json j = envelope(m, false);
  json arr = json::array();
  for (const ChoiceOut& c : choices) {
    const std::vector<TokenLogprob>& lps = c.logprobs ? *c.logprobs : none();
    json choice = {{"index", c.index}};
    if (m.kind == ApiKind::Chat) {
      choice["message"] = {{"role", "assistant"}, {"content", c.text}};
      choice["logprobs"] = m.logprobs >= 0 ? chat_logprobs(m, lps) : json(nullptr);
    } else {
      choice["text"] = c.text;
      choice["logprobs"] = m.logprobs >= 0 ? completion_logprobs(m, c.prompt, lps, c.text_offset) : json(nullptr);
      if (c.prompt && c.prompt->prompt_top >= 0) choice["prompt_logprobs"] = prompt_logprobs_json(m, *c.prompt);
    }
    choice["finish_reason"] = c.finish_reason ? c.finish_reason : "stop";
    arr.push_back(std::move(choice));
  }
  j["choices"] = std::move(arr);
  j["usage"] = usage(m, prompt_tokens, completion_tokens);
  return dump(j);
}

std::string full_response(const ResponseMeta& m, const std::string& text,
                          const std::vector<TokenLogprob>& logprobs, FinishReason reason,
                          int64_t prompt_tokens, int64_t completion_tokens) {
  ChoiceOut c;
  c.text = text;
  c.logprobs = &logprobs;
  c.finish_reason = api_finish_reason(reason);
  return full_response(m, std::vector<ChoiceOut>{c}, prompt_tokens, completion_tokens);
}

std::string stream_chunk(const ResponseMeta& m, const ChoiceOut& c) {
  json j = envelope(m, true);
  const std::vector<TokenLogprob>& lps = c.logprobs ? *c.logprobs : none();
  json choice = {{"index", c.index}};
  if (m.kind == ApiKind::Chat) {
    json d = json::object();
    if (c.role_header) d["role"] = "assistant";
    if (!c.text.empty() || c.role_header) d["content"] = c.text;
    choice["delta"] = std::move(d);
    choice["logprobs"] = m.logprobs >= 0 && !lps.empty() ? chat_logprobs(m, lps) : json(nullptr);
  } else {
    const bool echoed = c.prompt && c.prompt->echo_top >= 0;
    choice["text"] = c.text;
    choice["logprobs"] = m.logprobs >= 0 && (!lps.empty() || echoed)
                             ? completion_logprobs(m, c.prompt, lps, c.text_offset)
                             : json(nullptr);
    if (c.prompt && c.prompt->prompt_top >= 0) choice["prompt_logprobs"] = prompt_logprobs_json(m, *c.prompt);
  }
  choice["finish_reason"] = c.finish_reason ? json(c.finish_reason) : json(nullptr);
  j["choices"] = json::array({choice});
  return "data: " + dump(j) + "\n\n";
}

std::string stream_chunk(const ResponseMeta& m, const std::string& delta,
                         const std::vector<TokenLogprob>& logprobs, const char* reason,
                         bool role_header, size_t text_offset) {
  ChoiceOut c;
  c.text = delta;
  c.logprobs = &logprobs;
  c.text_offset = text_offset;
  c.finish_reason = reason;
  c.role_header = role_header;
  return stream_chunk(m, c);
}

std::string usage_chunk(const ResponseMeta& m, int64_t prompt_tokens, int64_t completion_tokens) {
  json j = envelope(m, true);
  j["choices"] = json::array();
  j["usage"] = usage(m, prompt_tokens, completion_tokens);
  return "data: " + dump(j) + "\n\n";
}

std::string stream_error(const ApiError& e) { return "data: " + error_json(e) + "\n\n"; }

}  // namespace spade::server
