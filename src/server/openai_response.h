// OpenAI-shaped response bodies: whole completions and chat completions, and the
// Server-Sent-Events chunks of their streaming forms (`data: {...}\n\n` ... `data: [DONE]`).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "engine/request.h"
#include "server/openai_request.h"

namespace spade::server {

struct ResponseMeta {
  ApiKind kind = ApiKind::Completion;
  std::string id;       // "cmpl-..." / "chatcmpl-..."
  int64_t created = 0;  // unix seconds
  std::string model;
  int logprobs = -1;    // as requested (< 0: none)
  const TokenText* text = nullptr;  // token pieces for logprobs
  // usage.sparse: the request's attention method (the server's when the request named none),
  // its options as given, its description with effective parameters, and the density it
  // reached over its decode steps (mean over choices; < 0: none, reported as null).
  std::string sparse_method = "full";
  std::vector<std::pair<std::string, std::string>> sparse_options;
  std::string sparse_description;
  double density = -1;
};

// OpenAI's finish_reason for the engine's: "stop", "length" (others: "stop").
const char* api_finish_reason(FinishReason r);

// A scored prompt (/v1/completions `echo` + `logprobs`, and the `prompt_logprobs`
// extension): the prompt's tokens, the text offset of each in the echoed text, and the
// engine's scores of tokens 1 .. P-1 (RequestDelta::prompt_logprobs; fewer while they have
// not arrived: the rest are null).
struct PromptScores {
  std::vector<int32_t> ids;
  std::vector<size_t> offsets;       // one per id
  std::vector<TokenLogprob> scores;  // scores[i] is token ids[i + 1] given ids[0 .. i]
  int echo_top = -1;    // >= 0: the prompt opens the choice's "logprobs", with this many alternatives
  int prompt_top = -1;  // >= 0: a "prompt_logprobs" list with this many alternatives per token
};

// One choice of a response (or of one streamed chunk).
struct ChoiceOut {
  int index = 0;
  std::string text;                                   // the choice's text (a chunk: its delta)
  const std::vector<TokenLogprob>* logprobs = nullptr;  // of the generated tokens of `text`
  size_t text_offset = 0;     // where the generated tokens' text starts in the choice's text
  const PromptScores* prompt = nullptr;  // echoed / scored prompt (a chunk: the first only)
  const char* finish_reason = nullptr;   // whole responses: always set; chunks: the last one
  bool role_header = false;              // chat chunks: the first, with {"role": "assistant"}
};

// A whole response with several choices; usage counts the prompt once and every choice's
// completion tokens.
std::string full_response(const ResponseMeta& m, const std::vector<ChoiceOut>& choices,
                          int64_t prompt_tokens, int64_t completion_tokens);
// One SSE event for one choice.
std::string stream_chunk(const ResponseMeta& m, const ChoiceOut& c);

// The non-streaming body.
std::string full_response(const ResponseMeta& m, const std::string& text,
                          const std::vector<TokenLogprob>& logprobs, FinishReason reason,
                          int64_t prompt_tokens, int64_t completion_tokens);

// One SSE event with a delta (text and, when asked, logprobs of the tokens it covers).
// `role_header`: chat only, the first chunk carrying {"role": "assistant"}.
// `reason`: non-null on the last content chunk.
std::string stream_chunk(const ResponseMeta& m, const std::string& delta,
                         const std::vector<TokenLogprob>& logprobs, const char* reason,
                         bool role_header, size_t text_offset);
// The usage chunk (stream_options.include_usage): empty choices, usage filled.
std::string usage_chunk(const ResponseMeta& m, int64_t prompt_tokens, int64_t completion_tokens);
// An error inside a stream (headers already sent) and the terminator.
std::string stream_error(const ApiError& e);
inline const char* stream_done() { return "data: [DONE]\n\n"; }

}  // namespace spade::server
