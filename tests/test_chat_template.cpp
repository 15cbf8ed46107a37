// Chat templates: spade's rendering of each model's own template equals transformers'
// apply_chat_template output (tests/fixtures/tokenizer/chat_templates.json, written by
// python/make_chat_template_fixtures.py), and the rendered prompt tokenizes with the
// special tokens recognized.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "test_tokenizer_common.h"

using namespace spade;
using namespace spade::test;
using ojson = nlohmann::ordered_json;

namespace {

std::string model_path(const std::string& model) {
  if (model == "llama3" || model == "qwen3") return tok_shared(model);
  if (model == "qwen2") return tok_shared("gguf-vocab/ggml-vocab-qwen2.gguf");
  return std::string(SPADE_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
}

TEST(ChatTemplate, MatchesTransformers) {
  auto cases = ojson::parse(read_all(tok_fixture("chat_templates.json")));
  ASSERT_GT(cases.size(), 30u);
  int checked = 0, via_messages = 0;
  std::set<std::string> models;
  for (const auto& c : cases) {
    std::string path = model_path(c["model"]);
    if (!exists(path)) continue;
    const Tokenizer& tok = cached_tokenizer(path);
    const ChatTemplate* tmpl = tok.chat_template();
    ASSERT_NE(tmpl, nullptr) << c["model"];
    ojson ctx = ojson::object();
    ctx["messages"] = c["messages"];
    ctx["add_generation_prompt"] = c["add_generation_prompt"];
    for (auto it = c["extra"].begin(); it != c["extra"].end(); ++it) ctx[it.key()] = it.value();
    std::string want = c["expected"];
    EXPECT_EQ(tmpl->render_context(ctx), want) << c["model"] << " / " << c["name"];
    ++checked;
    models.insert(c["model"]);
    // The ChatMessage entry point gives the same text when messages are role + content.
    bool plain = true;
    std::vector<ChatMessage> msgs;
    for (const auto& m : c["messages"]) {
      plain = plain && m.size() == 2;
      msgs.push_back({m["role"], m["content"]});
    }
    if (plain) {
      nlohmann::json extra = nlohmann::json::parse(c["extra"].dump());
      EXPECT_EQ(tmpl->render(msgs, c["add_generation_prompt"], extra), want) << c["name"];
      ++via_messages;
    }
  }
  EXPECT_GE(checked, 29);  // smollm2 cases need the fetched model
  EXPECT_GE(models.size(), 3u);
  EXPECT_GT(via_messages, 20);
}

TEST(ChatTemplate, Qwen3ThinkingSwitch) {
  const Tokenizer& tok = cached_tokenizer(tok_shared("qwen3"));
  std::vector<ChatMessage> msgs = {{"user", "Hi"}};
  std::string off = tok.chat_template()->render(msgs, true, {{"enable_thinking", false}});
  std::string on = tok.chat_template()->render(msgs, true);
  EXPECT_EQ(off, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
  EXPECT_EQ(on, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
}

TEST(ChatTemplate, RenderedPromptTokenizesSpecials) {
  const Tokenizer& tok = cached_tokenizer(tok_shared("llama3"));
  std::string p = tok.chat_template()->render({{"user", "Hi"}}, true);
  auto ids = tok.encode(p, /*add_special=*/false);
  // <|begin_of_text|> <|start_header_id|> user <|end_header_id|> \n\n Hi <|eot_id|> ...
  ASSERT_GE(ids.size(), 7u);
  EXPECT_EQ(ids[0], 128000);
  EXPECT_EQ(ids[1], 128006);
  EXPECT_EQ(ids[3], 128007);
  EXPECT_EQ(ids[6], 128009);
  EXPECT_EQ(tok.decode(ids), p);
  // eos_ids include <|eot_id|> for Llama-3 and <|im_end|> / <|endoftext|> for Qwen3.
  const auto& e = tok.eos_ids();
  EXPECT_NE(std::find(e.begin(), e.end(), 128009), e.end());
  const Tokenizer& q = cached_tokenizer(tok_shared("qwen3"));
  EXPECT_EQ(q.eos_id(), 151645);
  EXPECT_NE(std::find(q.eos_ids().begin(), q.eos_ids().end(), 151643), q.eos_ids().end());
}

TEST(ChatTemplate, SmolLM2FromGgufMetadata) {
  std::string path = model_path("smollm2");
  if (!exists(path)) GTEST_SKIP() << "model not fetched";
  const Tokenizer& tok = cached_tokenizer(path);
  ASSERT_NE(tok.chat_template(), nullptr);
  std::string p = tok.chat_template()->render({{"user", "Hi"}}, true);
  EXPECT_EQ(p,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
            "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  auto ids = tok.encode(p);
  EXPECT_EQ(ids.front(), 1);  // <|im_start|>, no BOS added (add_bos_token false)
  EXPECT_EQ(tok.eos_id(), 2);
}

}  // namespace
