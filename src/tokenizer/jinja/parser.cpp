#include "tokenizer/jinja/parser.h"

#include "core/error.h"
#include "tokenizer/jinja/lexer.h"

namespace spade::jinja {

namespace {

using lex::Tok;
using lex::syntax;

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
  Parser p(lex::tokenize(source));
  return p.parse_all();
}

}  // namespace spade::jinja
