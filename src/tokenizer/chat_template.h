// Chat templates: the model's own Jinja `chat_template` (tokenizer_config.json,
// chat_template.jinja, or GGUF tokenizer.chat_template) rendered by spade's Jinja subset
// interpreter (src/tokenizer/jinja/) with the environment transformers uses
// (trim_blocks, lstrip_blocks, loop controls, tojson, raise_exception, strftime_now).
// Anything outside the subset fails with a spade::Error naming the construct.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace spade {

namespace jinja {
class Template;
}

struct ChatMessage {
  std::string role, content;
};

class ChatTemplate {
 public:
  // `tokens`: bos_token, eos_token, unk_token, pad_token as transformers passes them.
  ChatTemplate(std::string source, std::map<std::string, std::string> tokens);
  ~ChatTemplate();
  // messages, add_generation_prompt, and e.g. {"enable_thinking": false} or {"tools": [...]}.
  std::string render(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                     const nlohmann::json& extra_vars = {}) const;
  // Full control over the variables (messages with tool_calls, reasoning_content, ...);
  // key order of objects is kept, as it matters to `tojson`. The special tokens are added
  // unless the context sets them.
  std::string render_context(const nlohmann::ordered_json& context) const;
  const std::string& source() const { return source_; }

 private:
  std::string source_;
  std::map<std::string, std::string> tokens_;
  std::shared_ptr<const jinja::Template> tmpl_;
};

}  // namespace spade
