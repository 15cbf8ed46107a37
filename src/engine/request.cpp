#include "engine/request.h"

namespace spade {

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::Stop: return "stop";
    case FinishReason::Length: return "length";
    case FinishReason::Cancelled: return "cancelled";
    case FinishReason::Error: return "error";
    default: return "none";
  }
}

bool RequestChannel::wait_take(RequestDelta& out, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lk(mu_);
  auto ready = [&] {
    return !pending_.text.empty() || !pending_.tokens.empty() ||
           !pending_.prompt_logprobs.empty() || (pending_.finished && !taken_final_);
  };
  if (!ready()) {
    if (taken_final_) return false;
    cv_.wait_for(lk, timeout, ready);
    if (!ready()) return false;
  }
  // Swap buffers so both sides keep their capacity.
  out.text.clear();
  out.tokens.clear();
  out.logprobs.clear();
  out.prompt_logprobs.clear();
  std::swap(out.text, pending_.text);
  std::swap(out.tokens, pending_.tokens);
  std::swap(out.logprobs, pending_.logprobs);
  std::swap(out.prompt_logprobs, pending_.prompt_logprobs);
  out.finished = pending_.finished;
  out.reason = pending_.reason;
  out.error = pending_.error;
  out.prompt_tokens = pending_.prompt_tokens;
  out.completion_tokens = pending_.completion_tokens;
  out.density = pending_.density;
  if (pending_.finished) taken_final_ = true;
  return true;
}

bool RequestChannel::finished() const {
  std::lock_guard<std::mutex> lk(mu_);
  return pending_.finished;
}

void RequestChannel::emit(const std::string& text, int32_t token, const TokenLogprob* lp) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (pending_.finished) return;
    pending_.text += text;
    pending_.tokens.push_back(token);
    if (lp) pending_.logprobs.push_back(*lp);
  }
  cv_.notify_all();
}

void RequestChannel::emit_prompt_logprobs(std::vector<TokenLogprob>&& lps) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (pending_.finished) return;
    for (auto& l : lps) pending_.prompt_logprobs.push_back(std::move(l));
  }
  cv_.notify_all();
}

void RequestChannel::finish(FinishReason r, int64_t prompt_tokens, int64_t completion_tokens,
                            const std::string& error, double density) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (pending_.finished) return;
    pending_.finished = true;
    pending_.reason = r;
    pending_.error = error;
    pending_.prompt_tokens = prompt_tokens;
    pending_.completion_tokens = completion_tokens;
    pending_.density = density;
  }
  cv_.notify_all();
}

}  // namespace spade
