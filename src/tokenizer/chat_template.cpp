#include "tokenizer/chat_template.h"

#include "core/error.h"
#include "tokenizer/jinja/interp.h"

namespace spade {

ChatTemplate::ChatTemplate(std::string source, std::map<std::string, std::string> tokens)
    : source_(std::move(source)), tokens_(std::move(tokens)),
      tmpl_(std::make_shared<jinja::Template>(source_)) {}

ChatTemplate::~ChatTemplate() = default;

std::string ChatTemplate::render_context(const nlohmann::ordered_json& context) const {
  // The variables transformers' apply_chat_template passes: the special tokens, then
  // messages / tools / documents / add_generation_prompt, then the caller's extras.
  jinja::Dict vars;
  for (const auto& [k, v] : tokens_) vars.set(k, jinja::Value::str(v));
  vars.set("tools", jinja::Value::none());
  vars.set("documents", jinja::Value::none());
  vars.set("add_generation_prompt", jinja::Value::boolean(false));
  if (!context.is_object()) fail("chat template: the context must be a JSON object");
  for (auto it = context.begin(); it != context.end(); ++it)
    vars.set(it.key(), jinja::from_json(it.value()));
  return tmpl_->render(vars);
}

std::string ChatTemplate::render(const std::vector<ChatMessage>& messages,
                                 bool add_generation_prompt,
                                 const nlohmann::json& extra_vars) const {
  nlohmann::ordered_json ctx = nlohmann::ordered_json::object();
  nlohmann::ordered_json msgs = nlohmann::ordered_json::array();
  for (const auto& m : messages) msgs.push_back({{"role", m.role}, {"content", m.content}});
  ctx["messages"] = std::move(msgs);
  ctx["add_generation_prompt"] = add_generation_prompt;
  if (extra_vars.is_object())
    for (auto it = extra_vars.begin(); it != extra_vars.end(); ++it)
      ctx[it.key()] = nlohmann::ordered_json::parse(it.value().dump());
  else if (!extra_vars.is_null())
    fail("chat template: extra_vars must be a JSON object");
  return render_context(ctx);
}

}  // namespace spade
