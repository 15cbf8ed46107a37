#include "tokenizer/jinja/parser.h"

#include <charconv>
#include <cstdlib>
#include <cstring>

#include "core/error.h"
#include "tokenizer/unicode.h"

namespace spade::jinja {

namespace {

struct Tok {
  enum K { Text, VarBegin, VarEnd, BlockBegin, BlockEnd, Name, String, Int, Float, Op, Eof } k;
  std::string s;
  int64_t i = 0;
  double f = 0;
  int line = 0;
};

[[noreturn]] void syntax(int line, const std::string& msg) {
  fail("chat template: line ", line, ": ", msg);
}

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

// Bounds recursion on hostile input ("((((...", deeply nested blocks).
struct DepthGuard {
  int& d;
  DepthGuard(int& depth, int line) : d(depth) {
    if (++d > 200) syntax(line, "nesting too deep");
  }
  ~DepthGuard() { --d; }
};

class Parser {
 public:
  explicit Parser(std::vector<Tok> t) : t_(std::move(t)) {}

  Body parse_all() {
    Body b = parse_body({});
    if (peek().k != Tok::Eof) syntax(peek().line, "unexpected tag");
    return b;
  }

 private:
  const Tok& peek(size_t k = 0) const { return t_[std::min(p_ + k, t_.size() - 1)]; }
  Tok next() { return t_[std::min(p_++, t_.size() - 1)]; }
  bool is_op(const char* op, size_t k = 0) const { return peek(k).k == Tok::Op && peek(k).s == op; }
  bool is_name(const char* n, size_t k = 0) const { return peek(k).k == Tok::Name && peek(k).s == n; }
  void expect_op(const char* op) {
    if (!is_op(op)) syntax(peek().line, std::string("expected '") + op + "', found '" + peek().s + "'");
    ++p_;
  }
  void expect_name(const char* n) {
    if (!is_name(n)) syntax(peek().line, std::string("expected '") + n + "', found '" + peek().s + "'");
    ++p_;
  }
  std::string name() {
    if (peek().k != Tok::Name) syntax(peek().line, "expected a name, found '" + peek().s + "'");
    return next().s;
  }
  void expect_block_end() {
    if (peek().k != Tok::BlockEnd) syntax(peek().line, "expected '%}', found '" + peek().s + "'");
    ++p_;
  }

  // Statements until a block tag whose keyword is in `stops` (left unconsumed, after '{%').
  Body parse_body(const std::vector<std::string>& stops) {
    Body body;
    while (true) {
      const Tok& t = peek();
      if (t.k == Tok::Eof) {
        if (!stops.empty()) syntax(t.line, "missing '{% " + stops.back() + " %}'");
        return body;
      }
      if (t.k == Tok::Text) {
        auto s = std::make_unique<Stmt>(Stmt::Text, t.line);
        s->text = t.s;
        body.push_back(std::move(s));
        ++p_;
      } else if (t.k == Tok::VarBegin) {
        ++p_;
        auto s = std::make_unique<Stmt>(Stmt::Output, t.line);
        s->expr = expr();
        if (peek().k != Tok::VarEnd) syntax(peek().line, "expected '}}', found '" + peek().s + "'");
        ++p_;
        body.push_back(std::move(s));
      } else if (t.k == Tok::BlockBegin) {
        const Tok& kw = peek(1);
        for (const auto& st : stops)
          if (kw.k == Tok::Name && kw.s == st) {
            ++p_;  // leave the keyword for the caller
            return body;
          }
        ++p_;
        body.push_back(statement());
      } else {
        syntax(t.line, "unexpected token '" + t.s + "'");
      }
    }
  }

  StmtP statement() {
    DepthGuard guard(depth_, peek().line);
    int line = peek().line;
    std::string kw = name();
    if (kw == "if") {
      auto s = std::make_unique<Stmt>(Stmt::If, line);
      ExprP cond = expr();
      expect_block_end();
      while (true) {
        Body b = parse_body({"elif", "else", "endif"});
        s->branches.emplace_back(std::move(cond), std::move(b));
        std::string k = name();
        if (k == "elif") {
          cond = expr();
          expect_block_end();
        } else if (k == "else") {
          expect_block_end();
          s->else_body = parse_body({"endif"});
          name();
          expect_block_end();
          return s;
        } else {
          expect_block_end();
          return s;
        }
      }
    }
    if (kw == "for") {
      auto s = std::make_unique<Stmt>(Stmt::For, line);
      s->targets.push_back(name());
      while (is_op(",")) {
        ++p_;
        s->targets.push_back(name());
      }
      expect_name("in");
      s->expr = expr(/*no_cond=*/true);
      if (is_name("if")) {
        ++p_;
        s->filter = expr(true);
      }
      if (is_name("recursive")) syntax(line, "recursive for loops are not supported");
      expect_block_end();
      Body b = parse_body({"else", "endfor"});
      s->branches.emplace_back(nullptr, std::move(b));
      if (name() == "else") {
        expect_block_end();
        s->else_body = parse_body({"endfor"});
        name();
      }
      expect_block_end();
      return s;
    }
    if (kw == "set") {
      std::vector<std::string> targets;
      std::string t = name();
      if (is_op(".")) {
        ++p_;
        t += "." + name();
      }
      targets.push_back(t);
      while (is_op(",")) {
        ++p_;
        targets.push_back(name());
      }
      if (is_op("=")) {
        ++p_;
        auto s = std::make_unique<Stmt>(Stmt::Set, line);
        s->targets = std::move(targets);
        s->expr = expr();
        if (is_op(",")) {  // a, b = 1, 2
          auto tup = std::make_unique<Expr>(Expr::TupleLit, line);
          tup->args.push_back(std::move(s->expr));
          while (is_op(",")) {
            ++p_;
            tup->args.push_back(expr());
          }
          s->expr = std::move(tup);
        }
        expect_block_end();
        return s;
      }
      if (is_op("|")) syntax(line, "filtered set blocks are not supported");
      expect_block_end();
      auto s = std::make_unique<Stmt>(Stmt::SetBlock, line);
      s->name = targets[0];
      Body b = parse_body({"endset"});
      s->branches.emplace_back(nullptr, std::move(b));
      name();
      expect_block_end();
      return s;
    }
    if (kw == "macro") {
      auto s = std::make_unique<Stmt>(Stmt::Macro, line);
      s->name = name();
      expect_op("(");
      while (!is_op(")")) {
        std::string pn = name();
        ExprP def;
        if (is_op("=")) {
          ++p_;
          def = expr();
        }
        s->params.emplace_back(pn, std::move(def));
        if (!is_op(")")) expect_op(",");
      }
      expect_op(")");
      expect_block_end();
      Body b = parse_body({"endmacro"});
      s->branches.emplace_back(nullptr, std::move(b));
      name();
      if (peek().k == Tok::Name) ++p_;  // {% endmacro name %}
      expect_block_end();
      return s;
    }
    if (kw == "break" || kw == "continue") {
      expect_block_end();
      return std::make_unique<Stmt>(kw == "break" ? Stmt::Break : Stmt::Continue, line);
    }
    if (kw == "generation") {  // transformers' AssistantTracker: renders its body
      expect_block_end();
      auto s = std::make_unique<Stmt>(Stmt::If, line);
      auto yes = std::make_unique<Expr>(Expr::Literal, line);
      yes->value = Value::boolean(true);
      Body b = parse_body({"endgeneration"});
      s->branches.emplace_back(std::move(yes), std::move(b));
      name();
      expect_block_end();
      return s;
    }
    if (kw == "filter") {
      auto s = std::make_unique<Stmt>(Stmt::FilterBlock, line);
      auto f = std::make_unique<Expr>(Expr::Filter, line);
      f->name = name();
      if (is_op("(")) call_args(*f);
      s->expr = std::move(f);
      expect_block_end();
      Body b = parse_body({"endfilter"});
      s->branches.emplace_back(nullptr, std::move(b));
      name();
      expect_block_end();
      return s;
    }
    syntax(line, "unsupported statement '{% " + kw + " %}'");
  }

  // ---- expressions (Jinja precedence) ----
  ExprP expr(bool no_cond = false) {
    DepthGuard guard(depth_, peek().line);
    ExprP e = or_expr();
    if (!no_cond && is_name("if")) {
      int line = peek().line;
      ++p_;
      auto c = std::make_unique<Expr>(Expr::Cond, line);
      c->b = or_expr();  // condition
      c->a = std::move(e);
      if (is_name("else")) {
        ++p_;
        c->c = expr();
      }
      return c;
    }
    return e;
  }
  ExprP binary(ExprP l, const std::string& op, ExprP r, int line) {
    auto e = std::make_unique<Expr>(Expr::Binary, line);
    e->name = op;
    e->a = std::move(l);
    e->b = std::move(r);
    return e;
  }
  ExprP or_expr() {
    ExprP l = and_expr();
    while (is_name("or")) {
      int line = next().line;
      l = binary(std::move(l), "or", and_expr(), line);
    }
    return l;
  }
  ExprP and_expr() {
    ExprP l = not_expr();
    while (is_name("and")) {
      int line = next().line;
      l = binary(std::move(l), "and", not_expr(), line);
    }
    return l;
  }
  ExprP not_expr() {
    DepthGuard guard(depth_, peek().line);
    if (is_name("not")) {
      int line = next().line;
      auto e = std::make_unique<Expr>(Expr::Unary, line);
      e->name = "not";
      e->a = not_expr();
      return e;
    }
    return compare();
  }
  ExprP compare() {
    ExprP l = math1();
    while (true) {
      int line = peek().line;
      std::string op;
      if (is_op("==") || is_op("!=") || is_op("<") || is_op(">") || is_op("<=") || is_op(">=")) {
        op = next().s;
      } else if (is_name("in")) {
        ++p_;
        op = "in";
      } else if (is_name("not") && is_name("in", 1)) {
        p_ += 2;
        op = "not in";
      } else {
        return l;
      }
      l = binary(std::move(l), op, math1(), line);
    }
  }
  ExprP math1() {
    ExprP l = concat();
    while (is_op("+") || is_op("-")) {
      Tok t = next();
      l = binary(std::move(l), t.s, concat(), t.line);
    }
    return l;
  }
  ExprP concat() {
    ExprP l = math2();
    while (is_op("~")) {
      int line = next().line;
      l = binary(std::move(l), "~", math2(), line);
    }
    return l;
  }
  ExprP math2() {
    ExprP l = pow_expr();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      Tok t = next();
      l = binary(std::move(l), t.s, pow_expr(), t.line);
    }
    return l;
  }
  ExprP pow_expr() {
    ExprP l = unary();
    while (is_op("**")) {
      int line = next().line;
      l = binary(std::move(l), "**", unary(), line);
    }
    return l;
  }
  ExprP unary() {
    DepthGuard guard(depth_, peek().line);
    if (is_op("-") || is_op("+")) {
      Tok t = next();
      auto e = std::make_unique<Expr>(Expr::Unary, t.line);
      e->name = t.s;
      e->a = unary();
      return e;
    }
    ExprP e = postfix(primary());
    return filters(std::move(e));
  }
  void call_args(Expr& e) {
    expect_op("(");
    while (!is_op(")")) {
      if (peek().k == Tok::Name && is_op("=", 1)) {
        std::string k = next().s;
        ++p_;
        e.kwargs.emplace_back(k, expr());
      } else {
        e.args.push_back(expr());
      }
      if (!is_op(")")) expect_op(",");
    }
    expect_op(")");
  }
  ExprP postfix(ExprP e) {
    while (true) {
      int line = peek().line;
      if (is_op(".")) {
        ++p_;
        auto a = std::make_unique<Expr>(Expr::Attr, line);
        a->a = std::move(e);
        if (peek().k == Tok::Int) {  // x.0 -> x[0]
          a->kind = Expr::Item;
          auto idx = std::make_unique<Expr>(Expr::Literal, line);
          idx->value = Value::integer(next().i);
          a->b = std::move(idx);
        } else {
          a->name = name();
        }
        e = std::move(a);
      } else if (is_op("[")) {
        ++p_;
        ExprP start, stop, step;
        bool slice = false;
        if (!is_op(":")) start = expr();
        if (is_op(":")) {
          slice = true;
          ++p_;
          if (!is_op("]") && !is_op(":")) stop = expr();
          if (is_op(":")) {
            ++p_;
            if (!is_op("]")) step = expr();
          }
        }
        expect_op("]");
        auto it = std::make_unique<Expr>(slice ? Expr::Slice : Expr::Item, line);
        it->a = std::move(e);
        if (slice) {
          it->args.push_back(std::move(start));
          it->args.push_back(std::move(stop));
          it->args.push_back(std::move(step));
        } else {
          it->b = std::move(start);
        }
        e = std::move(it);
      } else if (is_op("(")) {
        auto c = std::make_unique<Expr>(Expr::Call, line);
        c->a = std::move(e);
        call_args(*c);
        e = std::move(c);
      } else {
        return e;
      }
    }
  }
  ExprP filters(ExprP e) {
    while (true) {
      int line = peek().line;
      if (is_op("|")) {
        ++p_;
        auto f = std::make_unique<Expr>(Expr::Filter, line);
        f->name = name();
        while (is_op(".")) {  // dotted filter names are not a thing; keep the error clear
          syntax(line, "unexpected '.' after filter name");
        }
        f->a = std::move(e);
        if (is_op("(")) call_args(*f);
        e = std::move(f);
      } else if (is_name("is")) {
        ++p_;
        auto t = std::make_unique<Expr>(Expr::Test, line);
        if (is_name("not")) {
          ++p_;
          t->negated = true;
        }
        t->name = name();
        t->a = std::move(e);
        if (is_op("(")) {
          call_args(*t);
        } else if (peek().k == Tok::String || peek().k == Tok::Int || peek().k == Tok::Float ||
                   (peek().k == Tok::Name && !is_name("and") && !is_name("or") &&
                    !is_name("else") && !is_name("if") && !is_name("in") && !is_name("not") &&
                    !is_name("is"))) {
          t->args.push_back(postfix(primary()));  // "is divisibleby 3", "is sameas none"
        }
        e = std::move(t);
      } else {
        return e;
      }
    }
  }
  ExprP primary() {
    Tok t = next();
    auto lit = [&](Value v) {
      auto e = std::make_unique<Expr>(Expr::Literal, t.line);
      e->value = std::move(v);
      return e;
    };
    switch (t.k) {
      case Tok::String: {
        std::string s = t.s;
        while (peek().k == Tok::String) s += next().s;  // adjacent literals concatenate
        return lit(Value::str(s));
      }
      case Tok::Int: return lit(Value::integer(t.i));
      case Tok::Float: return lit(Value::number(t.f));
      case Tok::Name: {
        if (t.s == "true" || t.s == "True") return lit(Value::boolean(true));
        if (t.s == "false" || t.s == "False") return lit(Value::boolean(false));
        if (t.s == "none" || t.s == "None") return lit(Value::none());
        auto e = std::make_unique<Expr>(Expr::Name, t.line);
        e->name = t.s;
        return e;
      }
      case Tok::Op:
        if (t.s == "(") {
          if (is_op(")")) {
            ++p_;
            return std::make_unique<Expr>(Expr::TupleLit, t.line);
          }
          ExprP e = expr();
          if (is_op(",")) {
            auto tup = std::make_unique<Expr>(Expr::TupleLit, t.line);
            tup->args.push_back(std::move(e));
            while (is_op(",")) {
              ++p_;
              if (is_op(")")) break;
              tup->args.push_back(expr());
            }
            e = std::move(tup);
          }
          expect_op(")");
          return e;
        }
        if (t.s == "[") {
          auto l = std::make_unique<Expr>(Expr::ListLit, t.line);
          while (!is_op("]")) {
            l->args.push_back(expr());
            if (!is_op("]")) expect_op(",");
          }
          ++p_;
          return l;
        }
        if (t.s == "{") {
          auto d = std::make_unique<Expr>(Expr::DictLit, t.line);
          while (!is_op("}")) {
            ExprP k = expr();
            expect_op(":");
            d->pairs.emplace_back(std::move(k), expr());
            if (!is_op("}")) expect_op(",");
          }
          ++p_;
          return d;
        }
        break;
      default: break;
    }
    syntax(t.line, "unexpected '" + (t.s.empty() ? std::string("end of tag") : t.s) + "' in expression");
  }

  std::vector<Tok> t_;
  size_t p_ = 0;
  int depth_ = 0;
};

}  // namespace

Body parse_template(const std::string& source) {
  Lexer lx(source);
  Parser p(lx.run());
  return p.parse_all();
}

}  // namespace spade::jinja
