#!/usr/bin/env python3
"""Writes tests/fixtures/tokenizer/chat_templates.json: conversations and the text
transformers' apply_chat_template renders for them (tokenize=False), per model.

  llama3, qwen3  AutoTokenizer.from_pretrained(../shared/fixtures/tokenizers/<name>) and
                 tokenizer.apply_chat_template(...)
  smollm2, qwen2 the template string stored in the GGUF (tokenizer.chat_template of
                 models/SmolLM2-135M-Instruct.Q4_1.gguf / ggml-vocab-qwen2.gguf) rendered by
                 transformers' own renderer, transformers.utils.chat_template_utils.
                 render_jinja_template (the function apply_chat_template calls: jinja2
                 ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks), with the
                 special tokens the GGUF names (bos/eos/unk/pad), as apply_chat_template
                 passes a tokenizer's special_tokens_map. transformers cannot build a
                 tokenizer from a GGUF here without torch, hence this route.

Needs transformers, jinja2, gguf (not in CI). Run from the repository root:
  python3 python/make_chat_template_fixtures.py
"""
import json
import os

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
SHARED = os.path.join(ROOT, "..", "shared", "fixtures", "tokenizers")
OUT = os.path.join(ROOT, "tests", "fixtures", "tokenizer", "chat_templates.json")
SMOLLM2 = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")

BASIC = [
    ("single_user", [{"role": "user", "content": "Hello!"}]),
    ("system_user", [{"role": "system", "content": "You are a terse assistant."},
                     {"role": "user", "content": "What is 2+2?"}]),
    ("multi_turn", [{"role": "system", "content": "Be helpful."},
                    {"role": "user", "content": "Hi, who are you?"},
                    {"role": "assistant", "content": "I am a model."},
                    {"role": "user", "content": "Tell me a joke about {{ braces }} and {% tags %}."}]),
    ("no_system_two_turns", [{"role": "user", "content": "  padded question \n"},
                             {"role": "assistant", "content": "Answer with 'quotes' and \"doubles\"."},
                             {"role": "user", "content": "Unicode: 漢字 🦙 Äpfel\nsecond line"}]),
]

QWEN3_EXTRA = [
    ("thinking_off", [{"role": "user", "content": "Quick: capital of France?"}], True,
     {"enable_thinking": False}),
    ("thinking_on", [{"role": "user", "content": "Think about it."}], True, {"enable_thinking": True}),
    ("assistant_with_think", [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nsimple sum\n</think>\n\n4"},
        {"role": "user", "content": "and 3+3?"}], True, {}),
    ("last_assistant_reasoning", [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "add them"}], False, {}),
    ("tools", [
        {"role": "system", "content": "You can call tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather",
                                              "arguments": {"city": "Paris", "unit": "C"}}}]},
        {"role": "tool", "content": "{\"temp\": 21}"},
        {"role": "tool", "content": "second result"},
        {"role": "user", "content": "<tool_response>\nx\n</tool_response>"}], True,
     {"tools": [{"type": "function", "function": {
         "name": "get_weather", "description": "Weather for a city",
         "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                          "unit": {"type": "string", "enum": ["C", "F"]}},
                        "required": ["city"]}}}]}),
]


def gguf_string(path, key):
    from gguf import GGUFReader
    r = GGUFReader(path)
    return r.fields[key].contents()


def gguf_tokens(path):
    from gguf import GGUFReader
    r = GGUFReader(path)
    toks = r.fields["tokenizer.ggml.tokens"]
    out = {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        f = r.fields.get("tokenizer.ggml." + key)
        if f is not None:
            out[name] = toks.contents(int(f.contents()))
    return out


def main():
    from transformers import AutoTokenizer
    from transformers.utils.chat_template_utils import render_jinja_template

    cases = []

    def add(model, name, messages, agp, extra, text):
        cases.append({"model": model, "name": name, "messages": messages,
                      "add_generation_prompt": agp, "extra": extra, "expected": text})

    for model in ("llama3", "qwen3"):
        tok = AutoTokenizer.from_pretrained(os.path.join(SHARED, model))
        for name, msgs in BASIC:
            for agp in (True, False):
                add(model, f"{name}_{'gen' if agp else 'nogen'}", msgs, agp, {},
                    tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=agp))
        if model == "qwen3":
            for name, msgs, agp, extra in QWEN3_EXTRA:
                add(model, name, msgs, agp, extra,
                    tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=agp, **extra))

    ggufs = [("qwen2", os.path.join(SHARED, "gguf-vocab", "ggml-vocab-qwen2.gguf"))]
    if os.path.exists(SMOLLM2):
        ggufs.append(("smollm2", SMOLLM2))
    for model, path in ggufs:
        template = gguf_string(path, "tokenizer.chat_template")
        special = gguf_tokens(path)
        for name, msgs in BASIC:
            for agp in (True, False):
                rendered, _ = render_jinja_template(conversations=[msgs], chat_template=template,
                                                    add_generation_prompt=agp, **special)
                add(model, f"{name}_{'gen' if agp else 'nogen'}", msgs, agp, {}, rendered[0])

    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(cases, f, ensure_ascii=False, indent=1)
    print(f"wrote {len(cases)} cases to {OUT}")


if __name__ == "__main__":
    main()
