#include "tokenizer/jinja/lexer.h"

#include <charconv>
#include <cstdlib>
#include <cstring>

#include "core/error.h"
#include "tokenizer/unicode.h"

namespace spade::jinja::lex {

void syntax(int line, const std::string& msg) {
  fail("chat template: line ", line, ": ", msg);
}

namespace {

bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

std::string decode_escapes(const std::string& s, int line) {
  std::string o;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '\\' || i + 1 >= s.size()) {
      o += s[i];
      continue;
    }
    char c = s[++i];
    switch (c) {
      case 'n': o += '\n'; break;
      case 't': o += '\t'; break;
      case 'r': o += '\r'; break;
      case 'b': o += '\b'; break;
      case 'f': o += '\f'; break;
      case 'v': o += '\v'; break;
      case 'a': o += '\a'; break;
      case '0': o += '\0'; break;
      case '\\': o += '\\'; break;
      case '\'': o += '\''; break;
      case '"': o += '"'; break;
      case '\n': break;
      case 'x': case 'u': case 'U': {
        size_t n = c == 'x' ? 2 : c == 'u' ? 4 : 8;
        if (i + n >= s.size()) syntax(line, "truncated escape in string literal");
        uint32_t cp = 0;
        for (size_t k = 1; k <= n; ++k) {
          char h = s[i + k];
          int d = isdigit(uint8_t(h)) ? h - '0' : (h >= 'a' && h <= 'f') ? h - 'a' + 10
                  : (h >= 'A' && h <= 'F') ? h - 'A' + 10 : -1;
          if (d < 0) syntax(line, "bad escape in string literal");
          cp = cp * 16 + uint32_t(d);
        }
        if (cp >= 0x110000 || (cp >= 0xD800 && cp < 0xE000)) syntax(line, "bad code point escape");
        uni::append_utf8(o, cp);
        i += n;
        break;
      }
      default: o += '\\'; o += c;
    }
  }
  return o;
}

class Lexer {
 public:
  explicit Lexer(const std::string& src) {
    // Newlines normalized to \n; one trailing newline dropped (keep_trailing_newline=False).
    for (size_t i = 0; i < src.size(); ++i) {
      if (src[i] == '\r') {
        s_ += '\n';
        if (i + 1 < src.size() && src[i + 1] == '\n') ++i;
      } else {
        s_ += src[i];
      }
    }
    if (!s_.empty() && s_.back() == '\n') s_.pop_back();
  }

  std::vector<Tok> run() {
    bool line_starting = true, strip_next = false;
    while (pos_ < s_.size()) {
      size_t start = find_tag(pos_);
      std::string text = s_.substr(pos_, start - pos_);
      if (strip_next) {
        size_t k = 0;
        while (k < text.size() && is_ws(text[k])) ++k;
        text.erase(0, k);
      }
      strip_next = false;
      if (start >= s_.size()) {
        emit_text(text);
        break;
      }
      char kind = s_[start + 1];  // '{', '%', '#'
      char sign = start + 2 < s_.size() ? s_[start + 2] : 0;
      if (sign == '-') {
        while (!text.empty() && is_ws(text.back())) text.pop_back();
      } else if (sign != '+' && kind != '{') {
        size_t l = text.rfind('\n');
        size_t l_pos = l == std::string::npos ? 0 : l + 1;
        if (l_pos > 0 || line_starting) {
          bool all_ws = l_pos < text.size();
          for (size_t k = l_pos; k < text.size(); ++k)
            if (!is_ws(text[k])) all_ws = false;
          if (all_ws) text.erase(l_pos);
        }
      }
      emit_text(text);
      pos_ = start + 2 + ((sign == '-' || sign == '+') ? 1 : 0);
      if (kind == '#') {
        size_t e = s_.find("#}", pos_);
        if (e == std::string::npos) syntax(line_at(start), "unterminated comment");
        bool minus = e > pos_ && s_[e - 1] == '-';
        pos_ = e + 2;
        finish_tag(minus, true, strip_next, line_starting);
        continue;
      }
      if (kind == '%' && raw_block()) {
        line_starting = false;
        continue;
      }
      out_.push_back({kind == '{' ? Tok::VarBegin : Tok::BlockBegin, "", 0, 0, line_at(start)});
      bool minus = lex_expr(kind == '{' ? '}' : '%');
      out_.push_back({kind == '{' ? Tok::VarEnd : Tok::BlockEnd, "", 0, 0, line_at(pos_)});
      finish_tag(minus, kind == '%', strip_next, line_starting);
    }
    out_.push_back({Tok::Eof, "", 0, 0, line_at(s_.size())});
    return std::move(out_);
  }

 private:
  int line_at(size_t p) {
    while (line_pos_ < p && line_pos_ < s_.size()) {
      if (s_[line_pos_] == '\n') ++line_;
      ++line_pos_;
    }
    return line_;
  }
  size_t find_tag(size_t from) {
    for (size_t i = from; i + 1 < s_.size(); ++i)
      if (s_[i] == '{' && (s_[i + 1] == '{' || s_[i + 1] == '%' || s_[i + 1] == '#')) return i;
    return s_.size();
  }
  void emit_text(const std::string& t) {
    if (!t.empty()) out_.push_back({Tok::Text, t, 0, 0, line_at(pos_)});
  }
  // After a tag's end: '-' strips what follows; trim_blocks eats one newline after %} / #}.
  void finish_tag(bool minus, bool block, bool& strip_next, bool& line_starting) {
    line_starting = false;
    if (minus) {
      strip_next = true;
      size_t k = pos_;
      while (k < s_.size() && is_ws(s_[k])) ++k;
      line_starting = k > pos_ && s_[k - 1] == '\n';
    } else if (block && pos_ < s_.size() && s_[pos_] == '\n') {
      ++pos_;
      line_starting = true;
    }
  }
  // {% raw %}...{% endraw %}: the body is text.
  bool raw_block() {
    size_t p = pos_;
    while (p < s_.size() && is_ws(s_[p])) ++p;
    if (s_.compare(p, 3, "raw") != 0 || (p + 3 < s_.size() && (isalnum(uint8_t(s_[p + 3])) || s_[p + 3] == '_')))
      return false;
    p += 3;
    while (p < s_.size() && is_ws(s_[p])) ++p;
    bool minus = s_.compare(p, 1, "-") == 0;
    if (minus) ++p;
    if (s_.compare(p, 2, "%}") != 0) return false;
    p += 2;
    size_t body = p;
    while (true) {
      size_t e = s_.find("{%", p);
      if (e == std::string::npos) syntax(line_at(pos_), "unterminated raw block");
      size_t q = e + 2;
      bool m2 = q < s_.size() && s_[q] == '-';
      if (m2) ++q;
      while (q < s_.size() && is_ws(s_[q])) ++q;
      if (s_.compare(q, 6, "endraw") == 0) {
        std::string text = s_.substr(body, e - body);
        if (minus) { size_t k = 0; while (k < text.size() && is_ws(text[k])) ++k; text.erase(0, k); }
        if (m2) while (!text.empty() && is_ws(text.back())) text.pop_back();
        size_t end = s_.find("%}", q);
        if (end == std::string::npos) syntax(line_at(e), "unterminated endraw");
        emit_text(text);
        pos_ = end + 2;
        if (pos_ < s_.size() && s_[pos_] == '\n') ++pos_;
        return true;
      }
      p = e + 2;
    }
  }
  // Tokens of an expression up to the closing }} or %}; returns whether it was -}} / -%}.
  bool lex_expr(char close) {
    int depth = 0;
    while (true) {
      while (pos_ < s_.size() && is_ws(s_[pos_])) ++pos_;
      if (pos_ >= s_.size()) syntax(line_at(pos_), "unterminated tag");
      int line = line_at(pos_);
      char c = s_[pos_];
      if (depth == 0) {
        if (c == '-' && pos_ + 2 < s_.size() + 0 && s_[pos_ + 1] == close && s_[pos_ + 2] == '}') {
          pos_ += 3;
          return true;
        }
        if (c == '+' && pos_ + 2 < s_.size() + 0 && s_[pos_ + 1] == close && s_[pos_ + 2] == '}') {
          pos_ += 3;
          return false;
        }
        if (c == close && pos_ + 1 < s_.size() && s_[pos_ + 1] == '}') {
          pos_ += 2;
          return false;
        }
      }
      if (isalpha(uint8_t(c)) || c == '_') {
        size_t b = pos_;
        while (pos_ < s_.size() && (isalnum(uint8_t(s_[pos_])) || s_[pos_] == '_')) ++pos_;
        out_.push_back({Tok::Name, s_.substr(b, pos_ - b), 0, 0, line});
      } else if (isdigit(uint8_t(c))) {
        size_t b = pos_;
        bool is_float = false;
        while (pos_ < s_.size() && (isdigit(uint8_t(s_[pos_])) || s_[pos_] == '_')) ++pos_;
        if (pos_ + 1 < s_.size() && s_[pos_] == '.' && isdigit(uint8_t(s_[pos_ + 1]))) {
          is_float = true;
          ++pos_;
          while (pos_ < s_.size() && (isdigit(uint8_t(s_[pos_])) || s_[pos_] == '_')) ++pos_;
        }
        if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
          size_t q = pos_ + 1;
          if (q < s_.size() && (s_[q] == '+' || s_[q] == '-')) ++q;
          if (q < s_.size() && isdigit(uint8_t(s_[q]))) {
            is_float = true;
            pos_ = q;
            while (pos_ < s_.size() && isdigit(uint8_t(s_[pos_]))) ++pos_;
          }
        }
        std::string num;
        for (size_t k = b; k < pos_; ++k)
          if (s_[k] != '_') num += s_[k];
        Tok t{is_float ? Tok::Float : Tok::Int, num, 0, 0, line};
        if (is_float) {
          t.f = std::strtod(num.c_str(), nullptr);
        } else {
          auto r = std::from_chars(num.data(), num.data() + num.size(), t.i);
          if (r.ec != std::errc()) syntax(line, "integer literal out of range: " + num);
        }
        out_.push_back(t);
      } else if (c == '\'' || c == '"') {
        size_t b = ++pos_;
        while (pos_ < s_.size() && s_[pos_] != c) {
          if (s_[pos_] == '\\') ++pos_;
          ++pos_;
        }
        if (pos_ >= s_.size()) syntax(line, "unterminated string literal");
        out_.push_back({Tok::String, decode_escapes(s_.substr(b, pos_ - b), line), 0, 0, line});
        ++pos_;
      } else {
        static const char* ops[] = {"**", "//", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%",
                                    "~", "|", ".", ",", ":", "(", ")", "[", "]", "{", "}", "<",
                                    ">", "="};
        bool found = false;
        for (const char* op : ops) {
          size_t n = std::strlen(op);
          if (s_.compare(pos_, n, op) == 0) {
            if (op[0] == '(' || op[0] == '[' || op[0] == '{') ++depth;
            if ((op[0] == ')' || op[0] == ']' || op[0] == '}') && depth > 0) --depth;
            out_.push_back({Tok::Op, op, 0, 0, line});
            pos_ += n;
            found = true;
            break;
          }
        }
        if (!found) syntax(line, std::string("unexpected character '") + c + "'");
      }
    }
  }

  std::string s_;
  size_t pos_ = 0, line_pos_ = 0;
  int line_ = 1;
  std::vector<Tok> out_;
};

}  // namespace

std::vector<Tok> tokenize(const std::string& source) { return Lexer(source).run(); }

}  // namespace spade::jinja::lex
