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
};

// OpenAI's finish_reason for the engine's: "stop", "length" (others: "stop").
const char* api_finish_reason(FinishReason r);

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
