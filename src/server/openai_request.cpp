#include "server/openai_request.h"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <limits>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "sparse/options.h"

namespace spade::server {

using json = nlohmann::json;

std::string error_json(const ApiError& e) {
  json j = {{"error",
             {{"message", e.message},
              {"type", e.type},
              {"param", e.param.empty() ? json(nullptr) : json(e.param)},
              {"code", e.code.empty() ? json(nullptr) : json(e.code)}}}};
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

bool valid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const unsigned c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    int len;
    unsigned cp;
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
      cp = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      cp = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (i + size_t(len) > n) return false;
    for (int k = 1; k < len; ++k) {
      const unsigned cc = p[i + size_t(k)];
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    if ((len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)) ||
        (cp >= 0xD800 && cp <= 0xDFFF))
      return false;
    i += size_t(len);
  }
  return true;
}

namespace {

// A field error; caught at the top of every parse function.
struct Bad {
  std::string message;
  std::string param;
  std::string code = "invalid_value";
};

[[noreturn]] void bad(const std::string& param, const std::string& msg,
                      const std::string& code = "invalid_value") {
  throw Bad{msg, param, code};
}

// Nesting depth of a JSON text (brackets outside strings), to refuse absurd nesting
// before the parser sees it.
int json_depth(std::string_view s) {
  int depth = 0, max_depth = 0;
  bool in_str = false, esc = false;
  for (char ch : s) {
    if (in_str) {
      if (esc) esc = false;
      else if (ch == '\\') esc = true;
      else if (ch == '"') in_str = false;
      continue;
    }
    if (ch == '"') in_str = true;
    else if (ch == '[' || ch == '{') max_depth = std::max(max_depth, ++depth);
    else if (ch == ']' || ch == '}') --depth;
  }
  return max_depth;
}

json parse_body(std::string_view body) {
  if (body.empty()) bad("", "the request body is empty; expected a JSON object", "invalid_json");
  if (json_depth(body) > kMaxJsonDepth)
    bad("", "the request JSON is nested more than 64 levels deep", "invalid_json");
  json j;
  try {
    j = json::parse(body.begin(), body.end());
  } catch (const json::exception& e) {
    bad("", std::string("the request body is not valid JSON: ") + e.what(), "invalid_json");
  }
  if (!j.is_object()) bad("", "the request body must be a JSON object", "invalid_json");
  return j;
}

const char* type_name(const json& v) {
  switch (v.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "a boolean";
    case json::value_t::string: return "a string";
    case json::value_t::array: return "an array";
    case json::value_t::object: return "an object";
    case json::value_t::number_float: return "a number";
    default: return "an integer";
  }
}

// The field, or nullptr when absent or null (OpenAI clients send null for "unset").
const json* field(const json& obj, const char* key) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

std::string num_text(double v) {
  char b[64];
  std::snprintf(b, sizeof b, "%.17g", v);
  return b;
}

bool get_bool(const json& obj, const char* key, bool def) {
  const json* v = field(obj, key);
  if (!v) return def;
  if (!v->is_boolean()) bad(key, cat("'", key, "' must be a boolean, got ", type_name(*v)));
  return v->get<bool>();
}

// A number in [lo, hi] (finite).
double get_number(const json& obj, const char* key, double def, double lo, double hi) {
  const json* v = field(obj, key);
  if (!v) return def;
  if (!v->is_number()) bad(key, cat("'", key, "' must be a number, got ", type_name(*v)));
  const double x = v->get<double>();
  if (!std::isfinite(x) || x < lo || x > hi)
    bad(key, cat("'", key, "' must be between ", num_text(lo), " and ", num_text(hi), ", got ",
                 v->dump()));
  return x;
}

// An integer in [lo, hi]; a number with an integral value (2.0) is accepted.
int64_t as_int(const json& v, const std::string& what, int64_t lo, int64_t hi) {
  if (!v.is_number())
    bad(what, cat("'", what, "' must be an integer, got ", type_name(v)));
  int64_t x;
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > uint64_t(hi)) bad(what, cat("'", what, "' must be at most ", hi, ", got ", u));
    x = int64_t(u);
  } else if (v.is_number_integer()) {
    x = v.get<int64_t>();
  } else {
    const double d = v.get<double>();
    if (!std::isfinite(d) || std::floor(d) != d)
      bad(what, cat("'", what, "' must be an integer, got ", v.dump()));
    if (d < double(lo) || d > double(hi))
      bad(what, cat("'", what, "' must be between ", lo, " and ", hi, ", got ", v.dump()));
    x = int64_t(d);
  }
  if (x < lo || x > hi) bad(what, cat("'", what, "' must be between ", lo, " and ", hi, ", got ", x));
  return x;
}

std::optional<int64_t> get_int(const json& obj, const char* key, int64_t lo, int64_t hi) {
  const json* v = field(obj, key);
  if (!v) return std::nullopt;
  return as_int(*v, key, lo, hi);
}

std::string get_string(const json& obj, const char* key, const std::string& def) {
  const json* v = field(obj, key);
  if (!v) return def;
  if (!v->is_string()) bad(key, cat("'", key, "' must be a string, got ", type_name(*v)));
  return v->get<std::string>();
}

std::vector<int32_t> token_list(const json& v, const std::string& what) {
  if (!v.is_array()) bad(what, cat("'", what, "' must be an array of token ids, got ", type_name(v)));
  std::vector<int32_t> ids;
  ids.reserve(v.size());
  for (const json& e : v) ids.push_back(int32_t(as_int(e, what, 0, std::numeric_limits<int32_t>::max())));
  return ids;
}

// Text of a message's "content": a string, null, or an array of {"type": "text", "text"}.
std::string message_content(const json& c, size_t i) {
  const std::string what = cat("messages[", i, "].content");
  if (c.is_null()) return {};
  if (c.is_string()) return c.get<std::string>();
  if (!c.is_array()) bad(what, cat("'", what, "' must be a string or an array of parts, got ", type_name(c)));
  std::string text;
  for (const json& part : c) {
    if (!part.is_object()) bad(what, cat("each part of '", what, "' must be an object"));
    const std::string type = get_string(part, "type", "");
    if (type != "text")
      bad(what, cat("'", what, "': only parts of type \"text\" are supported, got \"", type, "\""),
          "unsupported_value");
    const json* t = field(part, "text");
    if (!t || !t->is_string()) bad(what, cat("a text part of '", what, "' needs a string \"text\""));
    text += t->get<std::string>();
  }
  return text;
}

std::vector<ApiMessage> parse_messages(const json& obj) {
  const json* m = field(obj, "messages");
  if (!m) bad("messages", "'messages' is required", "missing_required_parameter");
  if (!m->is_array()) bad("messages", cat("'messages' must be an array, got ", type_name(*m)));
  if (m->empty()) bad("messages", "'messages' must not be empty");
  if (m->size() > 4096) bad("messages", "'messages' has more than 4096 entries");
  std::vector<ApiMessage> out;
  for (size_t i = 0; i < m->size(); ++i) {
    const json& e = (*m)[i];
    if (!e.is_object()) bad("messages", cat("messages[", i, "] must be an object, got ", type_name(e)));
    const json* role = field(e, "role");
    if (!role || !role->is_string() || role->get<std::string>().empty() ||
        role->get<std::string>().size() > 64)
      bad("messages", cat("messages[", i, "].role must be a non-empty string"));
    auto c = e.find("content");
    out.push_back({role->get<std::string>(), c == e.end() ? std::string() : message_content(*c, i)});
  }
  return out;
}

void reject_unsupported(const json& obj) {
  const int64_t n = get_int(obj, "n", 1, kMaxChoices).value_or(1);
  auto best_of = get_int(obj, "best_of", std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max());
  if (best_of && *best_of != 1 && *best_of != n)
    bad("best_of", "only 'best_of' = 1 (or equal to 'n') is supported", "unsupported_value");
  for (const char* key : {"presence_penalty", "frequency_penalty"}) {
    double v = get_number(obj, key, 0, -2, 2);
    if (v != 0) bad(key, cat("'", key, "' is not supported (use 'repetition_penalty')"), "unsupported_value");
  }
  if (const json* v = field(obj, "logit_bias")) {
    if (!v->is_object()) bad("logit_bias", "'logit_bias' must be an object");
    if (!v->empty()) bad("logit_bias", "'logit_bias' is not supported", "unsupported_value");
  }
  if (const json* v = field(obj, "suffix")) {
    if (!v->is_string()) bad("suffix", "'suffix' must be a string");
    if (!v->get<std::string>().empty()) bad("suffix", "'suffix' is not supported", "unsupported_value");
  }
  for (const char* key : {"tools", "functions"}) {
    if (const json* v = field(obj, key)) {
      if (!v->is_array()) bad(key, cat("'", key, "' must be an array"));
      if (!v->empty()) bad(key, cat("'", key, "' (tool calling) is not supported"), "unsupported_value");
    }
  }
  if (const json* v = field(obj, "response_format")) {
    if (!v->is_object()) bad("response_format", "'response_format' must be an object");
    if (get_string(*v, "type", "text") != "text")
      bad("response_format", "only response_format {\"type\": \"text\"} is supported", "unsupported_value");
  }
}

std::optional<SparseSpec> parse_sparse(const json& obj) {
  const json* v = field(obj, "sparse");
  if (!v) return std::nullopt;
  auto check_name = [](const std::string& name) {
    if (name.empty() || name.size() > 64)
      bad("sparse", "'sparse.method' must be a non-empty method name");
    for (char c : name)
      if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '+'))
        bad("sparse", cat("'sparse.method' has an invalid character in \"", name, "\""));
  };
  SparseSpec spec;
  if (v->is_string()) {  // "quest", or the CLI's form "quest:budget=256,dense_layers=2"
    const std::string text = v->get<std::string>();
    if (text.size() > 4096) bad("sparse", "'sparse' is too long");
    sparse::SparseConfig sc;
    try {
      sc = sparse::SparseConfig::parse_spec(text);
    } catch (const std::exception& e) {
      bad("sparse", cat("'sparse': ", e.what()));
    }
    spec.method = sc.method;
    check_name(spec.method);
    for (const auto& [k, val] : sc.options) spec.options.emplace_back(k, val);
    if (spec.options.size() > 64) bad("sparse", "'sparse' has too many options");
    return spec;
  }
  if (!v->is_object())
    bad("sparse", cat("'sparse' must be an object like {\"method\": \"quest\", \"budget\": 1024} "
                      "or a method name, got ", type_name(*v)));
  const json* m = field(*v, "method");
  if (!m || !m->is_string()) bad("sparse", "'sparse.method' must be a string naming the method");
  spec.method = m->get<std::string>();
  check_name(spec.method);
  auto add = [&](const std::string& key, const json& val) {
    if (key.empty() || key.size() > 64) bad("sparse", "'sparse' has an empty or too long option name");
    std::string text;
    if (val.is_boolean()) {
      text = val.get<bool>() ? "1" : "0";
    } else if (val.is_number_integer() || val.is_number_unsigned()) {
      text = val.dump();
    } else if (val.is_number_float()) {
      text = num_text(val.get<double>());
    } else if (val.is_string()) {
      text = val.get<std::string>();
      if (text.size() > 1024) bad("sparse", cat("'sparse.", key, "' is too long"));
    } else if (val.is_array()) {
      if (val.size() > 1024) bad("sparse", cat("'sparse.", key, "' has too many elements"));
      for (const json& e : val) {
        if (!e.is_number()) bad("sparse", cat("'sparse.", key, "' must be a list of numbers"));
        if (!text.empty()) text += ',';
        text += e.is_number_float() ? num_text(e.get<double>()) : e.dump();
      }
    } else {
      bad("sparse", cat("'sparse.", key, "' must be a number, string, boolean or list, got ",
                        type_name(val)));
    }
    for (auto& [k, old] : spec.options)
      if (k == key) {
        old = text;
        return;
      }
    spec.options.emplace_back(key, text);
  };
  for (auto it = v->begin(); it != v->end(); ++it) {
    if (it.key() == "method" || it->is_null()) continue;
    if (it.key() == "options") {
      if (!it->is_object()) bad("sparse", "'sparse.options' must be an object");
      for (auto o = it->begin(); o != it->end(); ++o)
        if (!o->is_null()) add(o.key(), *o);
      continue;
    }
    add(it.key(), *it);
  }
  if (spec.options.size() > 64) bad("sparse", "'sparse' has too many options");
  return spec;
}

// Fields shared by /v1/completions and /v1/chat/completions.
void parse_common(const json& obj, ApiRequest& r) {
  r.model = get_string(obj, "model", "");
  if (r.model.size() > 256) bad("model", "'model' is too long");
  reject_unsupported(obj);
  r.n = get_int(obj, "n", 1, kMaxChoices).value_or(1);
  r.temperature = get_number(obj, "temperature", 1.0, 0.0, 2.0);
  r.top_p = get_number(obj, "top_p", 1.0, 0.0, 1.0);
  if (r.top_p <= 0.0) bad("top_p", "'top_p' must be greater than 0");
  r.top_k = get_int(obj, "top_k", -1, kMaxTokensLimit).value_or(0);
  r.min_p = get_number(obj, "min_p", 0.0, 0.0, 1.0);
  r.repetition_penalty = get_number(obj, "repetition_penalty", 1.0, 0.0, 10.0);
  if (r.repetition_penalty <= 0.0) bad("repetition_penalty", "'repetition_penalty' must be greater than 0");
  if (const json* s = field(obj, "seed")) {
    if (s->is_number_unsigned()) r.seed = s->get<uint64_t>();
    else r.seed = uint64_t(as_int(*s, "seed", std::numeric_limits<int64_t>::min(),
                                  std::numeric_limits<int64_t>::max()));
  }
  if (const json* s = field(obj, "stop")) {
    if (s->is_string()) {
      r.stop.push_back(s->get<std::string>());
    } else if (s->is_array()) {
      if (s->size() > size_t(kMaxStopStrings))
        bad("stop", cat("'stop' may hold at most ", kMaxStopStrings, " strings"));
      for (const json& e : *s) {
        if (!e.is_string()) bad("stop", cat("'stop' must hold strings, got ", type_name(e)));
        r.stop.push_back(e.get<std::string>());
      }
    } else {
      bad("stop", cat("'stop' must be a string or an array of strings, got ", type_name(*s)));
    }
    for (const std::string& st : r.stop)
      if (st.empty() || st.size() > kMaxStopBytes)
        bad("stop", cat("each stop string must have 1 to ", kMaxStopBytes, " bytes"));
  }
  if (const json* s = field(obj, "stop_token_ids")) {
    r.stop_token_ids = token_list(*s, "stop_token_ids");
    if (r.stop_token_ids.size() > 256) bad("stop_token_ids", "'stop_token_ids' has more than 256 ids");
  }
  r.ignore_eos = get_bool(obj, "ignore_eos", false);
  r.stream = get_bool(obj, "stream", false);
  if (const json* so = field(obj, "stream_options")) {
    if (!so->is_object()) bad("stream_options", "'stream_options' must be an object");
    r.include_usage = get_bool(*so, "include_usage", false);
  }
  r.sparse = parse_sparse(obj);
}

template <typename Fn>
ParseResult guarded(Fn&& fn) {
  ParseResult res;
  try {
    res.request = fn();
  } catch (const Bad& b) {
    res.error.message = b.message;
    res.error.param = b.param;
    res.error.code = b.code;
  } catch (const std::bad_alloc&) {
    res.error.status = 413;
    res.error.message = "the request is too large";
    res.error.code = "request_too_large";
  } catch (const std::exception& e) {
    res.error.message = std::string("invalid request: ") + e.what();
  }
  return res;
}

}  // namespace

ParseResult parse_completion_request(std::string_view body) {
  return guarded([&] {
    const json obj = parse_body(body);
    ApiRequest r;
    r.kind = ApiKind::Completion;
    parse_common(obj, r);
    const json* p = field(obj, "prompt");
    if (!p) bad("prompt", "'prompt' is required", "missing_required_parameter");
    if (p->is_string()) {
      r.prompt = p->get<std::string>();
    } else if (p->is_array()) {
      if (p->empty()) bad("prompt", "'prompt' must not be an empty array");
      const json& first = (*p)[0];
      if (first.is_string() || first.is_array()) {
        if (p->size() != 1)
          bad("prompt", "only one prompt per request is supported (batch prompts: send "
                        "separate requests)", "unsupported_value");
        if (first.is_string()) {
          r.prompt = first.get<std::string>();
        } else {
          r.prompt_ids = token_list(first, "prompt");
          r.prompt_is_ids = true;
        }
      } else {
        r.prompt_ids = token_list(*p, "prompt");
        r.prompt_is_ids = true;
      }
      if (r.prompt_is_ids && r.prompt_ids.empty()) bad("prompt", "'prompt' has no tokens");
    } else {
      bad("prompt", cat("'prompt' must be a string, an array of token ids, or a one-element "
                        "array of either, got ", type_name(*p)));
    }
    r.echo = get_bool(obj, "echo", false);
    r.max_tokens = get_int(obj, "max_tokens", 0, kMaxTokensLimit);
    if (r.max_tokens && *r.max_tokens == 0 && !r.echo)
      bad("max_tokens", "'max_tokens' must be at least 1 (0 only with 'echo': true, to score the prompt)");
    if (auto lp = get_int(obj, "logprobs", 0, kMaxLogprobs)) r.logprobs = int(*lp);
    if (auto lp = get_int(obj, "prompt_logprobs", 0, kMaxLogprobs)) r.prompt_logprobs = int(*lp);
    return r;
  });
}

ParseResult parse_chat_request(std::string_view body) {
  return guarded([&] {
    const json obj = parse_body(body);
    ApiRequest r;
    r.kind = ApiKind::Chat;
    parse_common(obj, r);
    r.messages = parse_messages(obj);
    r.add_generation_prompt = get_bool(obj, "add_generation_prompt", true);
    r.max_tokens = get_int(obj, "max_completion_tokens", 1, kMaxTokensLimit);
    if (!r.max_tokens) r.max_tokens = get_int(obj, "max_tokens", 1, kMaxTokensLimit);
    if (get_bool(obj, "echo", false))
      bad("echo", "'echo' is supported on /v1/completions only", "unsupported_value");
    if (field(obj, "prompt_logprobs"))
      bad("prompt_logprobs", "'prompt_logprobs' is supported on /v1/completions only", "unsupported_value");
    if (get_bool(obj, "logprobs", false))
      r.logprobs = int(get_int(obj, "top_logprobs", 0, kMaxLogprobs).value_or(0));
    else if (get_int(obj, "top_logprobs", 0, kMaxLogprobs).value_or(0) > 0)
      bad("top_logprobs", "'top_logprobs' needs 'logprobs': true");
    return r;
  });
}

std::optional<TokenizeRequest> parse_tokenize_request(std::string_view body, ApiError& err) {
  std::optional<TokenizeRequest> out;
  ParseResult res = guarded([&] {
    const json obj = parse_body(body);
    TokenizeRequest t;
    if (field(obj, "messages")) {
      t.is_chat = true;
      t.messages = parse_messages(obj);
      t.add_generation_prompt = get_bool(obj, "add_generation_prompt", true);
    } else {
      const json* p = field(obj, "prompt");
      if (!p) bad("prompt", "'prompt' (a string) or 'messages' is required", "missing_required_parameter");
      if (!p->is_string()) bad("prompt", cat("'prompt' must be a string, got ", type_name(*p)));
      t.prompt = p->get<std::string>();
    }
    t.add_special_tokens = get_bool(obj, "add_special_tokens", !t.is_chat);
    out = std::move(t);
    return ApiRequest{};
  });
  if (!res.ok()) {
    err = res.error;
    return std::nullopt;
  }
  return out;
}

std::optional<DetokenizeRequest> parse_detokenize_request(std::string_view body, ApiError& err) {
  std::optional<DetokenizeRequest> out;
  ParseResult res = guarded([&] {
    const json obj = parse_body(body);
    const json* t = field(obj, "tokens");
    if (!t) bad("tokens", "'tokens' (an array of token ids) is required", "missing_required_parameter");
    out = DetokenizeRequest{token_list(*t, "tokens")};
    return ApiRequest{};
  });
  if (!res.ok()) {
    err = res.error;
    return std::nullopt;
  }
  return out;
}

}  // namespace spade::server
