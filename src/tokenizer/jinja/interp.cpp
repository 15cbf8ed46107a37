#include "tokenizer/jinja/interp.h"

#include <cmath>
#include <unordered_map>
#include <unordered_set>

#include "core/error.h"
#include "tokenizer/jinja/parser.h"

namespace spade::jinja {

[[noreturn]] static void rt_error(int line, const std::string& msg) {
  fail("chat template: line ", line, ": ", msg);
}

class Interp {
 public:
  explicit Interp(const Dict& vars) {
    scopes_.emplace_back();
    for (const auto& [k, v] : vars.items) scopes_[0][k] = v;
    scopes_.emplace_back();  // template-level variables
  }

  enum Flow { Normal, Break, Continue };

  Flow exec(const Body& body, std::string& out) {
    for (const auto& s : body) {
      Flow f = exec(*s, out);
      if (f != Normal) return f;
    }
    return Normal;
  }

  Value eval(const Expr& e);

  Value lookup(const std::string& name) const {
    for (size_t k = scopes_.size(); k-- > 0;) {
      auto it = scopes_[k].find(name);
      if (it != scopes_[k].end()) return it->second;
    }
    return make_global(name);
  }

 private:
  Flow exec(const Stmt& s, std::string& out);
  void assign(const std::string& target, const Value& v, int line);
  Value call_macro(const Stmt& m, const Args& args, int line);
  Value binary(const Expr& e);
  Value item(const Value& obj, const Value& key, int line);
  Value slice(const Value& obj, const Expr& e);
  Args eval_args(const Expr& e);

  std::vector<std::unordered_map<std::string, Value>> scopes_;
  int depth_ = 0;
};

namespace {
thread_local uint64_t t_work = 0;
}

void charge(uint64_t units) {
  t_work += units;
  if (t_work > 50'000'000) fail("chat template: too expensive to render (work budget exceeded)");
}

namespace {

List iterate(const Value& v, int line) {
  switch (v.type) {
    case Value::ListT: return *v.list;
    case Value::DictT: {
      List keys;
      for (const auto& [k, _] : v.dict->items) keys.push_back(Value::str(k));
      return keys;
    }
    case Value::Str: {
      List chars;
      std::u32string u = to_u32(v.s);
      for (char32_t c : u) chars.push_back(Value::str(from_u32(std::u32string(1, c))));
      return chars;
    }
    case Value::Undefined: return {};
    default: rt_error(line, "'" + type_name(v) + "' object is not iterable");
  }
}

// Whether v holds (through lists, dicts and namespaces) the dict `target`. Values form no
// cycles (lists and dicts are immutable; assign() below keeps namespaces out of themselves),
// so the walk ends; `seen` keeps shared sub-values from being walked twice.
bool holds(const Value& v, const Dict* target, std::unordered_set<const void*>& seen) {
  if (v.is_dict()) {
    if (v.dict.get() == target) return true;
    if (!seen.insert(v.dict.get()).second) return false;
    for (const auto& [k, x] : v.dict->items)
      if (holds(x, target, seen)) return true;
  } else if (v.is_list()) {
    if (!seen.insert(v.list.get()).second) return false;
    for (const Value& x : *v.list)
      if (holds(x, target, seen)) return true;
  }
  return false;
}

int64_t py_floordiv(int64_t a, int64_t b) {
  if (b == -1) return int64_t(0 - uint64_t(a));  // INT64_MIN / -1 would trap
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}

}  // namespace

Args Interp::eval_args(const Expr& e) {
  Args a;
  for (const auto& x : e.args) a.pos.push_back(eval(*x));
  for (const auto& [k, x] : e.kwargs) a.kw.emplace_back(k, eval(*x));
  return a;
}

Value Interp::item(const Value& obj, const Value& key, int line) {
  switch (obj.type) {
    case Value::DictT: {
      if (!key.is_str()) return Value();
      const Value* v = obj.dict->find(key.s);
      return v ? *v : Value();
    }
    case Value::ListT: {
      if (key.type != Value::Int && key.type != Value::Bool) return Value();
      int64_t i = key.as_int(), n = int64_t(obj.list->size());
      if (i < 0) i += n;
      return (i >= 0 && i < n) ? (*obj.list)[size_t(i)] : Value();
    }
    case Value::Str: {
      if (key.type != Value::Int) return Value();
      std::u32string u = to_u32(obj.s);
      int64_t i = key.i, n = int64_t(u.size());
      if (i < 0) i += n;
      return (i >= 0 && i < n) ? Value::str(from_u32(u.substr(size_t(i), 1))) : Value();
    }
    case Value::Undefined: rt_error(line, "cannot read '" + to_str(key) + "' of an undefined value");
    default: return Value();
  }
}

Value Interp::slice(const Value& obj, const Expr& e) {
  auto opt = [&](const ExprP& x, bool& has) -> int64_t {
    has = false;
    if (!x) return 0;
    Value v = eval(*x);
    if (v.is_none() || v.is_undefined()) return 0;
    has = true;
    return v.as_int();
  };
  bool hs, he, hp;
  int64_t start = opt(e.args[0], hs), stop = opt(e.args[1], he), step = opt(e.args[2], hp);
  if (!hp) step = 1;
  if (step == 0) rt_error(e.line, "slice step cannot be zero");
  auto pick = [&](int64_t n, auto&& get) {
    int64_t b, en;
    if (step > 0) {
      b = hs ? (start < 0 ? std::max<int64_t>(start + n, 0) : std::min(start, n)) : 0;
      en = he ? (stop < 0 ? std::max<int64_t>(stop + n, 0) : std::min(stop, n)) : n;
      for (int64_t i = b; i < en; i += step) get(i);
    } else {
      b = hs ? (start < 0 ? std::max<int64_t>(start + n, -1) : std::min(start, n - 1)) : n - 1;
      en = he ? (stop < 0 ? std::max<int64_t>(stop + n, -1) : std::min(stop, n - 1)) : -1;
      for (int64_t i = b; i > en; i += step) get(i);
    }
  };
  if (obj.is_list()) {
    List out;
    pick(int64_t(obj.list->size()), [&](int64_t i) { out.push_back((*obj.list)[size_t(i)]); });
    return Value::make_list(std::move(out));
  }
  if (obj.is_str()) {
    std::u32string u = to_u32(obj.s), out;
    pick(int64_t(u.size()), [&](int64_t i) { out.push_back(u[size_t(i)]); });
    return Value::str(from_u32(out));
  }
  rt_error(e.line, "cannot slice a " + type_name(obj));
}

Value Interp::binary(const Expr& e) {
  const std::string& op = e.name;
  if (op == "and") {
    Value l = eval(*e.a);
    return l.truthy() ? eval(*e.b) : l;
  }
  if (op == "or") {
    Value l = eval(*e.a);
    return l.truthy() ? l : eval(*e.b);
  }
  Value l = eval(*e.a), r = eval(*e.b);
  if (op == "==") return Value::boolean(equals(l, r));
  if (op == "!=") return Value::boolean(!equals(l, r));
  if (op == "<" || op == ">" || op == "<=" || op == ">=") {
    int c;
    try {
      c = compare(l, r);
    } catch (const Error& err) {
      rt_error(e.line, err.what());
    }
    return Value::boolean(op == "<" ? c < 0 : op == ">" ? c > 0 : op == "<=" ? c <= 0 : c >= 0);
  }
  if (op == "in" || op == "not in") {
    bool found = false;
    if (r.is_str()) {
      if (!l.is_str()) rt_error(e.line, "'in <string>' requires string as left operand");
      found = r.s.find(l.s) != std::string::npos;
    } else if (r.is_list()) {
      for (const auto& x : *r.list)
        if (equals(x, l)) found = true;
    } else if (r.is_dict()) {
      found = l.is_str() && r.dict->find(l.s);
    } else if (!r.is_undefined()) {
      rt_error(e.line, "argument of type '" + type_name(r) + "' is not iterable");
    }
    return Value::boolean(op == "in" ? found : !found);
  }
  if (op == "~") return Value::str(to_str(l) + to_str(r));
  if (l.is_undefined() || r.is_undefined())
    rt_error(e.line, "undefined value in '" + op + "' expression");
  if (op == "+") {
    if (l.is_str() && r.is_str()) return Value::str(l.s + r.s);
    if (l.is_list() && r.is_list()) {
      List x = *l.list;
      x.insert(x.end(), r.list->begin(), r.list->end());
      return Value::make_list(std::move(x));
    }
  }
  if (op == "*" && ((l.is_str() && r.type == Value::Int) || (r.is_str() && l.type == Value::Int))) {
    const Value& s = l.is_str() ? l : r;
    int64_t n = l.is_str() ? r.i : l.i;
    std::string o;
    for (int64_t k = 0; k < n && o.size() < (1u << 24); ++k) {
      o += s.s;
      charge(1 + s.s.size() / 64);
    }
    return Value::str(o);
  }
  if (!l.is_number() || !r.is_number())
    rt_error(e.line, "unsupported operand types for " + op + ": '" + type_name(l) + "' and '" +
                         type_name(r) + "'");
  bool fl = l.type == Value::Float || r.type == Value::Float;
  if (op == "/") {
    if (r.as_double() == 0) rt_error(e.line, "division by zero");
    return Value::number(l.as_double() / r.as_double());
  }
  if (op == "//" || op == "%") {
    if (r.as_double() == 0) rt_error(e.line, "division by zero");
    if (!fl) {
      int64_t q = py_floordiv(l.as_int(), r.as_int());
      return Value::integer(op == "//" ? q : int64_t(uint64_t(l.as_int()) - uint64_t(q) * uint64_t(r.as_int())));
    }
    double q = std::floor(l.as_double() / r.as_double());
    return Value::number(op == "//" ? q : l.as_double() - q * r.as_double());
  }
  if (op == "**") {
    if (!fl && r.as_int() >= 0) {
      uint64_t x = 1;
      for (int64_t k = 0; k < r.as_int() && k < 64; ++k) x *= uint64_t(l.as_int());
      return Value::integer(int64_t(x));
    }
    return Value::number(std::pow(l.as_double(), r.as_double()));
  }
  if (fl) {
    double a = l.as_double(), b = r.as_double();
    return Value::number(op == "+" ? a + b : op == "-" ? a - b : a * b);
  }
  uint64_t a = uint64_t(l.as_int()), b = uint64_t(r.as_int());  // wrap instead of UB
  return Value::integer(int64_t(op == "+" ? a + b : op == "-" ? a - b : a * b));
}

Value Interp::eval(const Expr& e) {
  switch (e.kind) {
    case Expr::Literal: return e.value;
    case Expr::Name: return lookup(e.name);
    case Expr::Attr: {
      Value o = eval(*e.a);
      if (o.is_dict()) {
        const Value* v = o.dict->find(e.name);
        return v ? *v : Value();
      }
      if (o.is_undefined()) rt_error(e.line, "cannot read attribute '" + e.name + "' of an undefined value");
      return Value();
    }
    case Expr::Item: return item(eval(*e.a), eval(*e.b), e.line);
    case Expr::Slice: return slice(eval(*e.a), e);
    case Expr::Call: {
      Args args = eval_args(e);
      if (e.a->kind == Expr::Attr) {
        Value o = eval(*e.a->a);
        Value out;
        if (call_method(o, e.a->name, args, out, e.line)) return out;
        if (o.is_dict()) {
          const Value* f = o.dict->find(e.a->name);
          if (f && f->type == Value::FuncT) return (*f->fn)(args);
        }
        rt_error(e.line, "'" + type_name(o) + "' has no method '" + e.a->name + "'");
      }
      Value f = eval(*e.a);
      if (f.type != Value::FuncT)
        rt_error(e.line, (e.a->kind == Expr::Name ? "'" + e.a->name + "'" : std::string("value")) +
                             " is not callable (" + type_name(f) + ")");
      return (*f.fn)(args);
    }
    case Expr::Filter: {
      Value v = eval(*e.a);
      return apply_filter(*this, e.name, v, eval_args(e), e.line);
    }
    case Expr::Test: {
      Value v = eval(*e.a);
      bool r = apply_test(*this, e.name, v, eval_args(e), e.line);
      return Value::boolean(e.negated ? !r : r);
    }
    case Expr::Unary: {
      Value v = eval(*e.a);
      if (e.name == "not") return Value::boolean(!v.truthy());
      if (!v.is_number()) rt_error(e.line, "bad operand type for unary " + e.name + ": '" + type_name(v) + "'");
      if (e.name == "+") return v.type == Value::Bool ? Value::integer(v.as_int()) : v;
      return v.type == Value::Float ? Value::number(-v.f) : Value::integer(int64_t(0 - uint64_t(v.as_int())));
    }
    case Expr::Binary: return binary(e);
    case Expr::Cond: {
      if (eval(*e.b).truthy()) return eval(*e.a);
      return e.c ? eval(*e.c) : Value();
    }
    case Expr::ListLit:
    case Expr::TupleLit: {
      List l;
      for (const auto& x : e.args) l.push_back(eval(*x));
      Value v = Value::make_list(std::move(l));
      v.tuple = e.kind == Expr::TupleLit;
      return v;
    }
    case Expr::DictLit: {
      Dict d;
      for (const auto& [k, v] : e.pairs) {
        Value key = eval(*k);
        if (!key.is_str()) rt_error(e.line, "only string keys are supported in dict literals");
        d.set(key.s, eval(*v));
      }
      return Value::make_dict(std::move(d));
    }
  }
  rt_error(e.line, "bad expression");
}

void Interp::assign(const std::string& target, const Value& v, int line) {
  size_t dot = target.find('.');
  if (dot == std::string::npos) {
    scopes_.back()[target] = v;
    return;
  }
  Value ns = lookup(target.substr(0, dot));
  if (!ns.is_dict() || !ns.ns)
    rt_error(line, "cannot assign attribute on a non-namespace object '" + target.substr(0, dot) + "'");
  // A namespace holding itself would be a reference cycle that is never freed (Python's
  // garbage collector collects it; shared pointers do not): refuse it.
  std::unordered_set<const void*> seen;
  if (holds(v, ns.dict.get(), seen))
    rt_error(line, "cannot assign to '" + target + "' a value that contains the namespace itself");
  ns.dict->set(target.substr(dot + 1), v);
}

Value Interp::call_macro(const Stmt& m, const Args& args, int line) {
  if (++depth_ > 64) rt_error(line, "macro recursion too deep");
  std::unordered_map<std::string, Value> frame;
  for (size_t k = 0; k < m.params.size(); ++k) {
    const auto& [pname, def] = m.params[k];
    Value v = args.get(k, pname.c_str());
    if (v.is_undefined() && def) v = eval(*def);
    frame[pname] = v;
  }
  auto saved = std::move(scopes_);
  scopes_ = {saved[0], saved[1], std::move(frame)};
  std::string out;
  try {
    exec(m.branches[0].second, out);
  } catch (...) {
    scopes_ = std::move(saved);
    --depth_;
    throw;
  }
  scopes_ = std::move(saved);
  --depth_;
  return Value::str(out);
}

Interp::Flow Interp::exec(const Stmt& s, std::string& out) {
  // Bounds for untrusted templates: work done and output size.
  charge(1);
  if (out.size() > (size_t(256) << 20)) rt_error(s.line, "template output over 256 MiB");
  switch (s.kind) {
    case Stmt::Text: out += s.text; return Normal;
    case Stmt::Output: out += to_str(eval(*s.expr)); return Normal;
    case Stmt::If:
      for (const auto& [cond, body] : s.branches)
        if (eval(*cond).truthy()) return exec(body, out);
      return exec(s.else_body, out);
    case Stmt::For: {
      List items = iterate(eval(*s.expr), s.line);
      if (s.filter) {
        List kept;
        for (auto& it : items) {
          scopes_.emplace_back();
          if (s.targets.size() == 1) scopes_.back()[s.targets[0]] = it;
          else if (it.is_list())
            for (size_t k = 0; k < s.targets.size() && k < it.list->size(); ++k)
              scopes_.back()[s.targets[k]] = (*it.list)[k];
          bool keep = eval(*s.filter).truthy();
          scopes_.pop_back();
          if (keep) kept.push_back(it);
        }
        items.swap(kept);
      }
      if (items.empty()) return exec(s.else_body, out);
      size_t n = items.size();
      charge(n);
      for (size_t i = 0; i < n; ++i) {
        scopes_.emplace_back();
        auto& sc = scopes_.back();
        const Value& it = items[i];
        if (s.targets.size() == 1) {
          sc[s.targets[0]] = it;
        } else {
          if (!it.is_list() || it.list->size() != s.targets.size())
            rt_error(s.line, "cannot unpack a " + type_name(it) + " into " +
                                 std::to_string(s.targets.size()) + " loop variables");
          for (size_t k = 0; k < s.targets.size(); ++k) sc[s.targets[k]] = (*it.list)[k];
        }
        Dict loop;
        loop.set("index", Value::integer(int64_t(i + 1)));
        loop.set("index0", Value::integer(int64_t(i)));
        loop.set("revindex", Value::integer(int64_t(n - i)));
        loop.set("revindex0", Value::integer(int64_t(n - i - 1)));
        loop.set("first", Value::boolean(i == 0));
        loop.set("last", Value::boolean(i + 1 == n));
        loop.set("length", Value::integer(int64_t(n)));
        loop.set("depth", Value::integer(1));
        loop.set("depth0", Value::integer(0));
        loop.set("previtem", i > 0 ? items[i - 1] : Value());
        loop.set("nextitem", i + 1 < n ? items[i + 1] : Value());
        loop.set("cycle", Value::func([i](Args& a) -> Value {
                   if (a.pos.empty()) fail("chat template: loop.cycle needs arguments");
                   return a.pos[i % a.pos.size()];
                 }));
        sc["loop"] = Value::make_dict(std::move(loop));
        Flow f;
        try {
          f = exec(s.branches[0].second, out);
        } catch (...) {
          scopes_.pop_back();
          throw;
        }
        scopes_.pop_back();
        if (f == Break) break;
      }
      return Normal;
    }
    case Stmt::Set: {
      Value v = eval(*s.expr);
      if (s.targets.size() == 1) {
        assign(s.targets[0], v, s.line);
      } else {
        if (!v.is_list() || v.list->size() != s.targets.size())
          rt_error(s.line, "cannot unpack into " + std::to_string(s.targets.size()) + " names");
        for (size_t k = 0; k < s.targets.size(); ++k) assign(s.targets[k], (*v.list)[k], s.line);
      }
      return Normal;
    }
    case Stmt::SetBlock: {
      std::string body;
      exec(s.branches[0].second, body);
      assign(s.name, Value::str(body), s.line);
      return Normal;
    }
    case Stmt::Macro: {
      const Stmt* m = &s;
      scopes_.back()[s.name] = Value::func([this, m](Args& a) { return call_macro(*m, a, m->line); });
      return Normal;
    }
    case Stmt::Break: return Break;
    case Stmt::Continue: return Continue;
    case Stmt::FilterBlock: {
      std::string body;
      exec(s.branches[0].second, body);
      Args a;
      for (const auto& x : s.expr->args) a.pos.push_back(eval(*x));
      for (const auto& [k, x] : s.expr->kwargs) a.kw.emplace_back(k, eval(*x));
      out += to_str(apply_filter(*this, s.expr->name, Value::str(body), a, s.line));
      return Normal;
    }
    case Stmt::CallBlock: rt_error(s.line, "call blocks are not supported");
  }
  return Normal;
}

Template::Template(const std::string& source) : body_(parse_template(source)) {}

std::string Template::render(const Dict& vars) const {
  t_work = 0;
  Interp ip(vars);
  std::string out;
  ip.exec(body_, out);
  return out;
}

// Used by builtins.cpp for filters that apply other filters/tests by name.
Value interp_lookup(Interp& ip, const std::string& name) { return ip.lookup(name); }

}  // namespace spade::jinja
