#define PCRE2_CODE_UNIT_WIDTH 8
#include "tokenizer/pretokenize_pcre.h"

#include <pcre2.h>

#include <mutex>

#include "core/error.h"

namespace spade::tok {

std::string onig_to_pcre2(const std::string& p) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      char d = p[i + 1];
      if (d == 's')
        out += in_class ? "\\s\\x{85}" : "[\\s\\x{85}]";
      else if (d == 'S' && !in_class)
        out += "[^\\s\\x{85}]";
      else {
        out += c;
        out += d;
      }
      ++i;
      continue;
    }
    if (c == '[' && !in_class) {
      in_class = true;
      out += c;
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];  // literal ] first
      continue;
    }
    if (c == ']' && in_class) in_class = false;
    out += c;
  }
  return out;
}

Pcre2Regex::Pcre2Regex(const std::string& pattern) {
  std::string p = onig_to_pcre2(pattern);
  int err = 0;
  PCRE2_SIZE off = 0;
  auto* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(p.data()), p.size(),
                             PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK, &err, &off, nullptr);
  if (!code) {
    PCRE2_UCHAR buf[256];
    pcre2_get_error_message(err, buf, sizeof buf);
    fail("tokenizer: cannot compile split regex '", pattern, "' at offset ", off, ": ",
         reinterpret_cast<char*>(buf));
  }
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // best effort: falls back to the interpreter
  code_ = code;
}

Pcre2Regex::~Pcre2Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

void Pcre2Regex::find_all(std::string_view s, std::vector<std::pair<size_t, size_t>>& out) const {
  auto* code = static_cast<pcre2_code*>(code_);
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(code, nullptr);
  size_t pos = 0;
  while (pos <= s.size()) {
    int rc = pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), pos,
                         PCRE2_NO_UTF_CHECK, md, nullptr);
    if (rc < 0) break;
    PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    size_t b = ov[0], e = ov[1];
    if (e == b) {  // empty match: step one character
      if (b >= s.size()) break;
      size_t step = 1;
      while (b + step < s.size() && (static_cast<unsigned char>(s[b + step]) & 0xC0) == 0x80) ++step;
      pos = b + step;
      continue;
    }
    out.push_back({b, e});
    pos = e;
  }
  pcre2_match_data_free(md);
}

}  // namespace spade::tok
