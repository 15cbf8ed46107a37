// tokenizer.json (+ tokenizer_config.json) -> TokenizerSpec. Supports the BPE model with
// the normalizers, pre-tokenizers, decoders and post-processors that the supported model
// families use; anything else is an error that names the component.
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "tokenizer/tokenizer.h"

namespace spade {

using nlohmann::json;
using namespace tok;

namespace {

struct Ctx {
  std::string source;
};

std::string str_or(const json& j, const char* key, const std::string& def = "") {
  auto it = j.find(key);
  return (it != j.end() && it->is_string()) ? it->get<std::string>() : def;
}
bool bool_or(const json& j, const char* key, bool def) {
  auto it = j.find(key);
  return (it != j.end() && it->is_boolean()) ? it->get<bool>() : def;
}
// tokenizer_config.json spells a token as a string or as {"content": ...}.
std::string token_text(const json& j) {
  if (j.is_string()) return j.get<std::string>();
  if (j.is_object()) return str_or(j, "content");
  return "";
}

void parse_normalizer(const Ctx& c, const json& j, Normalizer& out) {
  if (j.is_null()) return;
  std::string type = str_or(j, "type");
  if (type == "Sequence") {
    for (const auto& s : j.at("normalizers")) parse_normalizer(c, s, out);
  } else if (type == "NFC") {
    out.add({NormStep::Nfc, "", ""});
  } else if (type == "Prepend") {
    out.add({NormStep::Prepend, str_or(j, "prepend"), ""});
  } else if (type == "Replace") {
    const json& pat = j.at("pattern");
    if (pat.contains("Regex")) {
      out.add({NormStep::ReplaceRegex, "", str_or(j, "content")},
              std::make_shared<const Pcre2Regex>(onig_to_pcre2(pat.at("Regex").get<std::string>())));
    } else {
      SPADE_CHECK(pat.contains("String"), c.source, ": Replace normalizer needs a String or Regex pattern");
      out.add({NormStep::Replace, pat.at("String").get<std::string>(), str_or(j, "content")});
    }
  } else {
    fail(c.source, ": normalizer '", type, "' is not supported (supported: NFC, Prepend, "
         "Replace, Sequence)");
  }
}

SplitBehavior behavior_of(const Ctx& c, const std::string& b) {
  if (b == "Isolated" || b.empty()) return SplitBehavior::Isolated;
  if (b == "Removed") return SplitBehavior::Removed;
  if (b == "MergedWithPrevious") return SplitBehavior::MergedWithPrevious;
  if (b == "MergedWithNext") return SplitBehavior::MergedWithNext;
  if (b == "Contiguous") return SplitBehavior::Contiguous;
  fail(c.source, ": unknown split behavior '", b, "'");
}

void parse_pretok(const Ctx& c, const json& j, PreTokenizer& out, bool& byte_level,
                  int& strip) {
  if (j.is_null()) return;
  std::string type = str_or(j, "type");
  PreTokStage st;
  if (type == "Sequence") {
    for (const auto& s : j.at("pretokenizers")) parse_pretok(c, s, out, byte_level, strip);
    return;
  } else if (type == "Split") {
    st.kind = PreTokStage::Split;
    const json& pat = j.at("pattern");
    if (pat.contains("Regex")) {
      st.pattern = pat.at("Regex").get<std::string>();
    } else {
      st.pattern = pat.at("String").get<std::string>();
      st.literal = true;
    }
    st.behavior = behavior_of(c, str_or(j, "behavior"));
    st.invert = bool_or(j, "invert", false);
  } else if (type == "ByteLevel") {
    st.kind = PreTokStage::ByteLevel;
    st.add_prefix_space = bool_or(j, "add_prefix_space", true);
    st.use_regex = bool_or(j, "use_regex", true);
    byte_level = true;
  } else if (type == "Digits") {
    st.kind = PreTokStage::Digits;
    st.individual_digits = bool_or(j, "individual_digits", false);
  } else if (type == "Metaspace") {
    st.kind = PreTokStage::Metaspace;
    st.replacement = str_or(j, "replacement", "\xE2\x96\x81");
    std::string scheme = str_or(j, "prepend_scheme");
    if (scheme.empty()) scheme = bool_or(j, "add_prefix_space", true) ? "always" : "never";
    st.prepend = scheme == "always" ? PreTokStage::Always
                 : scheme == "first" ? PreTokStage::First
                                     : PreTokStage::Never;
    st.split = bool_or(j, "split", true);
  } else {
    fail(c.source, ": pre-tokenizer '", type, "' is not supported (supported: Split, "
         "ByteLevel, Digits, Metaspace, Sequence)");
  }
  out.add(std::move(st));
}

void parse_decoder(const json& j, int& strip) {
  if (j.is_null()) return;
  std::string type = str_or(j, "type");
  if (type == "Sequence") {
    for (const auto& d : j.at("decoders")) parse_decoder(d, strip);
  } else if (type == "Strip") {
    if (str_or(j, "content") == " ") strip = j.value("start", 0);
  } else if (type == "Metaspace") {
    std::string scheme = str_or(j, "prepend_scheme");
    if (scheme.empty()) scheme = bool_or(j, "add_prefix_space", true) ? "always" : "never";
    strip = scheme == "never" ? 0 : 1;
  }
}

// The id a TemplateProcessing names ("<s>" -> special_tokens["<s>"].ids[0]).
int32_t special_id(const json& tp, const std::string& name) {
  auto st = tp.find("special_tokens");
  if (st == tp.end() || !st->contains(name)) return -1;
  const json& ids = (*st)[name].at("ids");
  return ids.empty() ? -1 : ids[0].get<int32_t>();
}

void parse_post(const json& j, TokenizerSpec& s, int32_t& bos, int32_t& eos) {
  if (j.is_null()) return;
  std::string type = str_or(j, "type");
  if (type == "Sequence") {
    for (const auto& p : j.at("processors")) parse_post(p, s, bos, eos);
  } else if (type == "TemplateProcessing") {
    bool seen_seq = false;
    for (const auto& item : j.at("single")) {
      if (item.contains("Sequence")) {
        seen_seq = true;
      } else if (item.contains("SpecialToken")) {
        int32_t id = special_id(j, item["SpecialToken"].at("id").get<std::string>());
        if (!seen_seq) {
          s.add_bos = true;
          bos = id;
        } else {
          s.add_eos = true;
          eos = id;
        }
      }
    }
  }
}

}  // namespace

std::unique_ptr<Tokenizer> Tokenizer::from_hf_json(const std::string& tokenizer_json,
                                                   const std::string& config_json,
                                                   const std::string& source) {
  Ctx c{source};
  json j, cfg;
  try {
    j = json::parse(tokenizer_json);
    if (!config_json.empty()) cfg = json::parse(config_json);
  } catch (const json::exception& e) {
    fail(source, ": invalid JSON: ", e.what());
  }
  try {
    SPADE_CHECK(j.is_object() && j.contains("model"), source, ": no \"model\" object");
    const json& m = j.at("model");
    std::string mtype = str_or(m, "type", m.contains("merges") ? "BPE" : "");
    SPADE_CHECK(mtype == "BPE", source, ": model type '", mtype,
                "' is not supported (only BPE)");
    SPADE_CHECK(str_or(m, "continuing_subword_prefix").empty() &&
                    str_or(m, "end_of_word_suffix").empty(),
                source, ": BPE continuing_subword_prefix / end_of_word_suffix are not supported");
    TokenizerSpec s;
    s.source = source;
    const json& vocab = m.at("vocab");
    SPADE_CHECK(vocab.is_object(), source, ": model.vocab is not an object");
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      int64_t id = it.value().get<int64_t>();
      SPADE_CHECK(id >= 0 && size_t(id) < vocab.size() + 65536, source, ": token '", it.key(),
                  "' has id ", id, " (", vocab.size(), " tokens)");
      if (size_t(id) >= s.pieces.size()) s.pieces.resize(id + 1);
      s.pieces[id] = it.key();
    }
    if (m.contains("merges")) {
      const json& merges = m.at("merges");
      s.merges.reserve(merges.size());
      for (const auto& mg : merges) {
        if (mg.is_string()) {
          const std::string& t = mg.get_ref<const std::string&>();
          size_t sp = t.find(' ');
          SPADE_CHECK(sp != std::string::npos, source, ": merge '", t, "' has no space");
          s.merges.emplace_back(t.substr(0, sp), t.substr(sp + 1));
        } else {
          SPADE_CHECK(mg.is_array() && mg.size() == 2, source, ": malformed merge");
          s.merges.emplace_back(mg[0].get<std::string>(), mg[1].get<std::string>());
        }
      }
    }
    s.ignore_merges = bool_or(m, "ignore_merges", false);
    s.byte_fallback = bool_or(m, "byte_fallback", false);
    s.fuse_unk = bool_or(m, "fuse_unk", false);
    std::string unk = str_or(m, "unk_token");
    for (size_t i = 0; i < s.pieces.size() && !unk.empty(); ++i)
      if (s.pieces[i] == unk) s.unk_id = int32_t(i);

    if (j.contains("added_tokens")) {
      for (const auto& a : j.at("added_tokens")) {
        AddedToken t;
        t.id = a.at("id").get<int32_t>();
        t.content = a.at("content").get<std::string>();
        t.special = bool_or(a, "special", false);
        t.lstrip = bool_or(a, "lstrip", false);
        t.rstrip = bool_or(a, "rstrip", false);
        t.single_word = bool_or(a, "single_word", false);
        s.added.push_back(std::move(t));
      }
    }
    if (j.contains("normalizer")) parse_normalizer(c, j["normalizer"], s.normalizer);
    bool byte_level = false;
    int strip = 0;
    if (j.contains("pre_tokenizer")) parse_pretok(c, j["pre_tokenizer"], s.pretok, byte_level, strip);
    if (j.contains("decoder")) {
      if (str_or(j["decoder"], "type") == "ByteLevel") byte_level = true;
      parse_decoder(j["decoder"], strip);
    }
    s.kind = byte_level ? ModelKind::ByteLevelBpe : ModelKind::CharBpe;
    s.strip_leading_space = byte_level ? 0 : strip;

    auto id_of = [&](const std::string& text) -> int32_t {
      if (text.empty()) return -1;
      for (const auto& a : s.added)
        if (a.content == text) return a.id;
      for (size_t i = 0; i < s.pieces.size(); ++i)
        if (s.pieces[i] == text) return int32_t(i);
      return -1;
    };
    int32_t post_bos = -1, post_eos = -1;
    if (j.contains("post_processor")) parse_post(j["post_processor"], s, post_bos, post_eos);
    std::string bos_t = cfg.is_object() && cfg.contains("bos_token") ? token_text(cfg["bos_token"]) : "";
    std::string eos_t = cfg.is_object() && cfg.contains("eos_token") ? token_text(cfg["eos_token"]) : "";
    s.bos_id = !bos_t.empty() ? id_of(bos_t) : post_bos;
    s.eos_id = !eos_t.empty() ? id_of(eos_t) : post_eos;
    if (post_bos >= 0 && s.add_bos) s.bos_id = post_bos;
    if (cfg.is_object()) {
      // transformers rebuilds the post-processor from these flags when the config has them.
      if (cfg.contains("add_bos_token") && cfg["add_bos_token"].is_boolean())
        s.add_bos = cfg["add_bos_token"].get<bool>();
      if (cfg.contains("add_eos_token") && cfg["add_eos_token"].is_boolean())
        s.add_eos = cfg["add_eos_token"].get<bool>();
      for (const char* k : {"bos_token", "eos_token", "unk_token", "pad_token"})
        if (cfg.contains(k) && !cfg[k].is_null()) s.template_tokens[k] = token_text(cfg[k]);
      if (cfg.contains("chat_template")) {
        const json& ct = cfg["chat_template"];
        if (ct.is_string()) {
          s.chat_template = ct.get<std::string>();
        } else if (ct.is_array()) {
          for (const auto& e : ct)
            if (str_or(e, "name") == "default") s.chat_template = str_or(e, "template");
        }
      }
    }
    if (s.add_eos && s.eos_id < 0) s.eos_id = post_eos;
    return build(std::move(s));
  } catch (const json::exception& e) {
    fail(source, ": unexpected structure: ", e.what());
  }
}

}  // namespace spade
