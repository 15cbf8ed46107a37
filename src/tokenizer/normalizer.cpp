#include "tokenizer/normalizer.h"

#include "tokenizer/nfc.h"

namespace spade::tok {

std::string_view Normalizer::apply(std::string_view text, std::string& buf) const {
  if (steps_.empty() || text.empty()) return text;
  std::string cur;
  bool owned = false;
  std::string_view v = text;
  auto set = [&](std::string s) {
    cur = std::move(s);
    owned = true;
    v = cur;
  };
  for (size_t i = 0; i < steps_.size(); ++i) {
    const NormStep& st = steps_[i];
    switch (st.kind) {
      case NormStep::Nfc:
        if (!nfc_quick_check(v)) set(nfc(v));
        break;
      case NormStep::Prepend:
        if (!v.empty()) set(st.a + std::string(v));
        break;
      case NormStep::Replace: {
        if (st.a.empty() || v.find(st.a) == std::string_view::npos) break;
        std::string r;
        r.reserve(v.size() + v.size() / 2);
        size_t pos = 0;
        for (size_t f; (f = v.find(st.a, pos)) != std::string_view::npos; pos = f + st.a.size()) {
          r.append(v.substr(pos, f - pos));
          r += st.b;
        }
        r.append(v.substr(pos));
        set(std::move(r));
        break;
      }
      case NormStep::ReplaceRegex: {
        std::vector<std::pair<size_t, size_t>> m;
        regexes_[i]->find_all(v, m);
        if (m.empty()) break;
        std::string r;
        r.reserve(v.size());
        size_t pos = 0;
        for (const auto& [b, e] : m) {
          r.append(v.substr(pos, b - pos));
          r += st.b;
          pos = e;
        }
        r.append(v.substr(pos));
        set(std::move(r));
        break;
      }
      case NormStep::CollapseSpaces: {
        std::string r;
        r.reserve(v.size());
        for (char c : v) {
          if (c == ' ' && (r.empty() || r.back() == ' ')) continue;
          r.push_back(c);
        }
        while (!r.empty() && r.back() == ' ') r.pop_back();
        if (r != v) set(std::move(r));
        break;
      }
    }
  }
  if (!owned) return text;
  buf = std::move(cur);
  return buf;
}

}  // namespace spade::tok
