// OpenAI-compatible request parsing and validation, independent of the HTTP library, the
// tokenizer and the model, so that it can be unit-tested and fuzzed on raw bytes. Every
// malformed input (bad JSON, invalid UTF-8, wrong types, out-of-range or huge numbers,
// unsupported options, absurd nesting) becomes an ApiError with a message naming the field;
// nothing throws out of these functions.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace spade::server {

// An error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
struct ApiError {
  int status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // empty: null
  std::string code;   // empty: null
};
std::string error_json(const ApiError& e);

// The `sparse` extension: {"method": "quest", "budget": 1024, ...} (options may also sit
// in an "options" object) or just "quest". Option values are kept as text; the sparse
// framework validates them against the method's declared options.
struct SparseSpec {
  std::string method;
  std::vector<std::pair<std::string, std::string>> options;
};

struct ApiMessage {
  std::string role;
  std::string content;
};

enum class ApiKind { Completion, Chat };

struct ApiRequest {
  ApiKind kind = ApiKind::Completion;
  std::string model;
  // Completions: the prompt as text or as token ids.
  std::string prompt;
  std::vector<int32_t> prompt_ids;
  bool prompt_is_ids = false;
  bool echo = false;                  // the prompt opens the text (and, with logprobs, the logprobs)
  int prompt_logprobs = -1;           // vLLM's extension: < 0 off; else top k per prompt token
  // Chat.
  std::vector<ApiMessage> messages;
  bool add_generation_prompt = true;
  // Sampling and stopping.
  std::optional<int64_t> max_tokens;  // absent: the endpoint's default; 0 only with echo
  int64_t n = 1;                      // choices: independent samples, 1 .. kMaxChoices
  double temperature = 1.0;
  double top_p = 1.0;
  int64_t top_k = 0;                  // <= 0: off
  double min_p = 0.0;
  double repetition_penalty = 1.0;
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  int logprobs = -1;                  // < 0: off; else top alternatives per token
  // Streaming.
  bool stream = false;
  bool include_usage = false;
  std::optional<SparseSpec> sparse;
};

struct ParseResult {
  std::optional<ApiRequest> request;
  ApiError error;
  bool ok() const { return request.has_value(); }
};

// Limits on what a request may ask for.
constexpr int kMaxStopStrings = 16;
constexpr size_t kMaxStopBytes = 256;
constexpr int kMaxLogprobs = 20;
constexpr int64_t kMaxChoices = 16;  // 'n'
constexpr int kMaxJsonDepth = 64;
constexpr int64_t kMaxTokensLimit = int64_t(1) << 30;

ParseResult parse_completion_request(std::string_view body);
ParseResult parse_chat_request(std::string_view body);

// POST /tokenize: {"prompt": "...", "add_special_tokens": true} or {"messages": [...],
// "add_generation_prompt": true}. POST /detokenize: {"tokens": [ids]}.
struct TokenizeRequest {
  std::string prompt;
  std::vector<ApiMessage> messages;
  bool is_chat = false;
  bool add_special_tokens = true;
  bool add_generation_prompt = true;
};
struct DetokenizeRequest {
  std::vector<int32_t> tokens;
};
std::optional<TokenizeRequest> parse_tokenize_request(std::string_view body, ApiError& err);
std::optional<DetokenizeRequest> parse_detokenize_request(std::string_view body, ApiError& err);

// True if `s` is well-formed UTF-8 (no overlongs, surrogates or code points > U+10FFFF).
bool valid_utf8(std::string_view s);

}  // namespace spade::server
