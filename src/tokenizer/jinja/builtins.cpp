// Built-in filters, tests, methods and globals of the Jinja subset.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <climits>
#include <ctime>

#include "core/error.h"
#include "tokenizer/jinja/interp.h"
#include "tokenizer/unicode.h"

namespace spade::jinja {

Value interp_lookup(Interp& ip, const std::string& name);

namespace {

[[noreturn]] void err(int line, const std::string& msg) { fail("chat template: line ", line, ": ", msg); }

char32_t ascii_upper(char32_t c) { return (c >= 'a' && c <= 'z') ? c - 32 : c; }
char32_t ascii_lower(char32_t c) { return (c >= 'A' && c <= 'Z') ? c + 32 : c; }

std::string upper(const std::string& s) {
  std::string o = s;
  for (auto& c : o) c = char(ascii_upper(uint8_t(c)));
  return o;
}
std::string lower(const std::string& s) {
  std::string o = s;
  for (auto& c : o) c = char(ascii_lower(uint8_t(c)));
  return o;
}

std::string strip(const std::string& s, const Value& chars, bool left, bool right) {
  std::u32string u = to_u32(s), set;
  bool ws = chars.is_undefined() || chars.is_none();
  if (!ws) set = to_u32(to_str(chars));
  auto strip_it = [&](char32_t c) { return ws ? py_isspace(c) : set.find(c) != std::u32string::npos; };
  size_t b = 0, e = u.size();
  if (left) while (b < e && strip_it(u[b])) ++b;
  if (right) while (e > b && strip_it(u[e - 1])) --e;
  return from_u32(u.substr(b, e - b));
}

List split(const std::string& s, const Value& sep, int64_t maxsplit) {
  List out;
  if (sep.is_undefined() || sep.is_none()) {
    std::u32string u = to_u32(s);
    size_t i = 0;
    while (i < u.size()) {
      while (i < u.size() && py_isspace(u[i])) ++i;
      if (i >= u.size()) break;
      if (maxsplit >= 0 && int64_t(out.size()) == maxsplit) {
        size_t e = u.size();
        while (e > i && py_isspace(u[e - 1])) --e;
        out.push_back(Value::str(from_u32(u.substr(i, e - i))));
        break;
      }
      size_t j = i;
      while (j < u.size() && !py_isspace(u[j])) ++j;
      out.push_back(Value::str(from_u32(u.substr(i, j - i))));
      i = j;
    }
    return out;
  }
  std::string d = to_str(sep);
  if (d.empty()) fail("chat template: split: empty separator");
  size_t pos = 0;
  while (true) {
    size_t f = s.find(d, pos);
    if (f == std::string::npos || (maxsplit >= 0 && int64_t(out.size()) == maxsplit)) {
      out.push_back(Value::str(s.substr(pos)));
      break;
    }
    out.push_back(Value::str(s.substr(pos, f - pos)));
    pos = f + d.size();
  }
  return out;
}

std::string replace(const std::string& s, const std::string& a, const std::string& b, int64_t count) {
  std::string o;
  if (a.empty()) {  // Python inserts b between characters
    std::u32string u = to_u32(s);
    int64_t n = 0;
    for (char32_t c : u) {
      if (count < 0 || n < count) { o += b; ++n; }
      o += from_u32(std::u32string(1, c));
    }
    if (count < 0 || n < count) o += b;
    return o;
  }
  size_t pos = 0;
  int64_t n = 0;
  while (true) {
    size_t f = s.find(a, pos);
    if (f == std::string::npos || (count >= 0 && n >= count)) break;
    o.append(s, pos, f - pos);
    o += b;
    pos = f + a.size();
    ++n;
  }
  o.append(s, pos, std::string::npos);
  return o;
}

std::string title(const std::string& s) {
  std::u32string u = to_u32(s);
  bool prev_cased = false;
  for (auto& c : u) {
    bool letter = uni::is_letter(c);
    c = letter ? (prev_cased ? ascii_lower(c) : ascii_upper(c)) : c;
    prev_cased = letter;
  }
  return from_u32(u);
}

std::string capitalize(const std::string& s) {
  std::u32string u = to_u32(s);
  for (size_t k = 0; k < u.size(); ++k) u[k] = k == 0 ? ascii_upper(u[k]) : ascii_lower(u[k]);
  return from_u32(u);
}

Value attr_path(const Value& v, const std::string& path) {
  Value cur = v;
  size_t pos = 0;
  while (pos <= path.size()) {
    size_t dot = path.find('.', pos);
    std::string part = path.substr(pos, dot == std::string::npos ? std::string::npos : dot - pos);
    if (cur.is_dict()) {
      const Value* x = cur.dict->find(part);
      cur = x ? *x : Value();
    } else if (cur.is_list() && !part.empty() && std::all_of(part.begin(), part.end(), ::isdigit)) {
      size_t i = 0;
      auto r = std::from_chars(part.data(), part.data() + part.size(), i);
      cur = (r.ec == std::errc() && i < cur.list->size()) ? (*cur.list)[i] : Value();
    } else {
      return Value();
    }
    if (dot == std::string::npos) break;
    pos = dot + 1;
  }
  return cur;
}

const List& need_list(const Value& v, const char* what, int line, List& tmp) {
  charge(v.length() + 1);
  if (v.is_list()) return *v.list;
  if (v.is_dict() || v.is_str() || v.is_undefined()) {
    tmp.clear();
    if (v.is_dict()) for (const auto& [k, _] : v.dict->items) tmp.push_back(Value::str(k));
    if (v.is_str()) for (char32_t c : to_u32(v.s)) tmp.push_back(Value::str(from_u32(std::u32string(1, c))));
    return tmp;
  }
  err(line, std::string(what) + ": expected a sequence, got " + type_name(v));
}

std::string html_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    switch (c) {
      case '&': o += "&amp;"; break;
      case '<': o += "&lt;"; break;
      case '>': o += "&gt;"; break;
      case '"': o += "&#34;"; break;
      case '\'': o += "&#39;"; break;
      default: o += c;
    }
  }
  return o;
}

Args rest_args(const Args& a, size_t from) {
  Args r;
  for (size_t k = from; k < a.pos.size(); ++k) r.pos.push_back(a.pos[k]);
  r.kw = a.kw;
  return r;
}

}  // namespace

std::u32string to_u32(const std::string& s) {
  std::u32string u;
  u.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    size_t len;
    u.push_back(uni::decode(s.data() + i, s.size() - i, len));
    i += len;
  }
  return u;
}

std::string from_u32(const std::u32string& u) {
  std::string s;
  for (char32_t c : u) uni::append_utf8(s, c);
  return s;
}

bool py_isspace(char32_t c) { return uni::is_space(c) || (c >= 0x1C && c <= 0x1F); }

bool call_method(const Value& o, const std::string& m, const Args& a, Value& out, int line) {
  if (o.is_str()) {
    const std::string& s = o.s;
    if (m == "startswith" || m == "endswith") {
      const Value& p = a.get(0, nullptr);
      List opts;
      if (p.is_list()) opts = *p.list; else opts.push_back(p);
      bool r = false;
      for (const auto& x : opts) {
        if (!x.is_str()) err(line, m + " expects a string or a tuple of strings");
        if (m == "startswith" ? s.compare(0, x.s.size(), x.s) == 0 && s.size() >= x.s.size()
                              : s.size() >= x.s.size() && s.compare(s.size() - x.s.size(), x.s.size(), x.s) == 0)
          r = true;
      }
      out = Value::boolean(r);
      return true;
    }
    if (m == "strip" || m == "lstrip" || m == "rstrip") {
      out = Value::str(strip(s, a.get(0, "chars"), m != "rstrip", m != "lstrip"));
      return true;
    }
    if (m == "split") {
      const Value& mx = a.get(1, "maxsplit");
      out = Value::make_list(split(s, a.get(0, "sep"), mx.is_undefined() ? -1 : mx.as_int()));
      return true;
    }
    if (m == "splitlines") {
      List l;
      size_t pos = 0;
      while (pos < s.size()) {
        size_t e = s.find_first_of("\r\n", pos);
        if (e == std::string::npos) { l.push_back(Value::str(s.substr(pos))); break; }
        l.push_back(Value::str(s.substr(pos, e - pos)));
        pos = e + ((s[e] == '\r' && e + 1 < s.size() && s[e + 1] == '\n') ? 2 : 1);
      }
      out = Value::make_list(std::move(l));
      return true;
    }
    if (m == "upper") { out = Value::str(upper(s)); return true; }
    if (m == "lower") { out = Value::str(lower(s)); return true; }
    if (m == "title") { out = Value::str(title(s)); return true; }
    if (m == "capitalize") { out = Value::str(capitalize(s)); return true; }
    if (m == "replace") {
      const Value& c = a.get(2, "count");
      out = Value::str(replace(s, to_str(a.get(0, "old")), to_str(a.get(1, "new")), c.is_undefined() ? -1 : c.as_int()));
      return true;
    }
    if (m == "find" || m == "rfind" || m == "index" || m == "count") {
      std::string sub = to_str(a.get(0, nullptr));
      if (m == "count") {
        int64_t n = 0;
        if (sub.empty()) n = int64_t(to_u32(s).size()) + 1;
        else for (size_t p = s.find(sub); p != std::string::npos; p = s.find(sub, p + sub.size())) ++n;
        out = Value::integer(n);
        return true;
      }
      size_t p = m == "rfind" ? s.rfind(sub) : s.find(sub);
      if (p == std::string::npos && m == "index") err(line, "substring not found");
      out = Value::integer(p == std::string::npos ? -1 : int64_t(to_u32(s.substr(0, p)).size()));
      return true;
    }
    if (m == "join") {
      List tmp;
      const List& l = need_list(a.get(0, nullptr), "join", line, tmp);
      std::string r;
      for (size_t k = 0; k < l.size(); ++k) {
        if (k) r += s;
        if (!l[k].is_str()) err(line, "join: sequence item " + std::to_string(k) + " is not a string");
        r += l[k].s;
      }
      out = Value::str(r);
      return true;
    }
    if (m == "isdigit" || m == "isalpha" || m == "isalnum" || m == "isspace" || m == "isupper" || m == "islower") {
      std::u32string u = to_u32(s);
      bool r = !u.empty();
      bool cased = false;
      for (char32_t c : u) {
        if (m == "isdigit") r = r && uni::category(c) == uni::Nd;
        else if (m == "isalpha") r = r && uni::is_letter(c);
        else if (m == "isalnum") r = r && (uni::is_letter(c) || uni::is_number(c));
        else if (m == "isspace") r = r && py_isspace(c);
        else if (m == "isupper") { if (c >= 'a' && c <= 'z') r = false; if (c >= 'A' && c <= 'Z') cased = true; }
        else { if (c >= 'A' && c <= 'Z') r = false; if (c >= 'a' && c <= 'z') cased = true; }
      }
      if (m == "isupper" || m == "islower") r = r && cased;
      out = Value::boolean(r);
      return true;
    }
    return false;
  }
  if (o.is_dict() && !o.ns) {
    if (m == "get") {
      const Value* v = o.dict->find(to_str(a.get(0, nullptr)));
      const Value& def = a.get(1, "default");
      out = v ? *v : (def.is_undefined() ? Value::none() : def);
      return true;
    }
    if (m == "items" || m == "keys" || m == "values") {
      List l;
      for (const auto& [k, v] : o.dict->items) {
        if (m == "items") {
          l.push_back(Value::make_list({Value::str(k), v}));
          l.back().tuple = true;
        }
        else if (m == "keys") l.push_back(Value::str(k));
        else l.push_back(v);
      }
      out = Value::make_list(std::move(l));
      return true;
    }
    if (m == "update" || m == "pop" || m == "setdefault" || m == "clear")
      err(line, "dict." + m + " is not allowed (the template environment is immutable)");
    return false;
  }
  if (o.is_list()) {
    if (m == "append" || m == "extend" || m == "pop" || m == "insert" || m == "remove" ||
        m == "sort" || m == "reverse" || m == "clear")
      err(line, "list." + m + " is not allowed (the template environment is immutable)");
    if (m == "index" || m == "count") {
      const Value& x = a.get(0, nullptr);
      int64_t n = 0, idx = -1;
      for (size_t k = 0; k < o.list->size(); ++k)
        if (equals((*o.list)[k], x)) { if (idx < 0) idx = int64_t(k); ++n; }
      if (m == "index" && idx < 0) err(line, "list.index(x): x not in list");
      out = Value::integer(m == "index" ? idx : n);
      return true;
    }
  }
  return false;
}

bool apply_test(Interp& ip, const std::string& t, const Value& v, const Args& a, int line) {
  const Value& x = a.get(0, nullptr);
  if (t == "defined") return !v.is_undefined();
  if (t == "undefined") return v.is_undefined();
  if (t == "none") return v.is_none();
  if (t == "boolean") return v.type == Value::Bool;
  if (t == "true") return v.type == Value::Bool && v.b;
  if (t == "false") return v.type == Value::Bool && !v.b;
  if (t == "integer") return v.type == Value::Int;
  if (t == "float") return v.type == Value::Float;
  if (t == "number") return v.is_number();
  if (t == "string") return v.is_str();
  if (t == "mapping") return v.is_dict() && !v.ns;
  if (t == "iterable") return v.is_list() || v.is_str() || (v.is_dict() && !v.ns);
  if (t == "sequence") return v.is_list() || v.is_str() || (v.is_dict() && !v.ns);
  if (t == "callable") return v.type == Value::FuncT;
  if (t == "sameas") {
    if (v.type != x.type) return false;
    if (v.is_list()) return v.list == x.list;
    if (v.is_dict()) return v.dict == x.dict;
    return equals(v, x);
  }
  if (t == "eq" || t == "equalto" || t == "==") return equals(v, x);
  if (t == "ne" || t == "!=") return !equals(v, x);
  if (t == "lt" || t == "lessthan" || t == "<") return compare(v, x) < 0;
  if (t == "le" || t == "<=") return compare(v, x) <= 0;
  if (t == "gt" || t == "greaterthan" || t == ">") return compare(v, x) > 0;
  if (t == "ge" || t == ">=") return compare(v, x) >= 0;
  if (t == "in") {
    if (x.is_str()) return v.is_str() && x.s.find(v.s) != std::string::npos;
    if (x.is_list()) return std::any_of(x.list->begin(), x.list->end(), [&](const Value& e) { return equals(e, v); });
    if (x.is_dict()) return v.is_str() && x.dict->find(v.s);
    return false;
  }
  if (t == "odd" || t == "even" || t == "divisibleby") {
    if (v.type != Value::Int && v.type != Value::Bool) err(line, "test '" + t + "' needs an integer");
    int64_t n = v.as_int();
    if (t == "odd") return n % 2 != 0;
    if (t == "even") return n % 2 == 0;
    int64_t d = x.as_int();
    if (d == 0) err(line, "divisibleby 0");
    return n % d == 0;
  }
  if (t == "lower") return v.is_str() && lower(v.s) == v.s;
  if (t == "upper") return v.is_str() && upper(v.s) == v.s;
  (void)ip;
  err(line, "unsupported test '" + t + "'");
}

Value apply_filter(Interp& ip, const std::string& f, const Value& v, const Args& a, int line) {
  auto need_str = [&](const char* what) -> std::string {
    if (v.is_undefined()) return "";
    return to_str(v);
  };
  if (f == "safe" || f == "string") return f == "safe" ? v : Value::str(to_str(v));
  if (f == "trim") return Value::str(strip(need_str("trim"), a.get(0, "chars"), true, true));
  if (f == "length" || f == "count") {
    if (!(v.is_str() || v.is_list() || v.is_dict() || v.is_undefined()))
      err(line, "object of type '" + type_name(v) + "' has no len()");
    return Value::integer(int64_t(v.length()));
  }
  if (f == "tojson") {
    const Value& ind = a.get(0, "indent");
    bool sort = a.get(3, "sort_keys").truthy();
    try {
      return Value::str(to_json(v, ind.is_undefined() || ind.is_none() ? -1 : int(ind.as_int()), sort));
    } catch (const Error& e) {
      err(line, e.what());
    }
  }
  if (f == "default" || f == "d") {
    bool boolean = a.get(1, "boolean").truthy();
    if (v.is_undefined() || (boolean && !v.truthy())) {
      const Value& d = a.get(0, "default_value");
      return d.is_undefined() ? Value::str("") : d;
    }
    return v;
  }
  if (f == "upper") return Value::str(upper(need_str("upper")));
  if (f == "lower") return Value::str(lower(need_str("lower")));
  if (f == "title") return Value::str(title(need_str("title")));
  if (f == "capitalize") return Value::str(capitalize(need_str("capitalize")));
  if (f == "replace") {
    const Value& c = a.get(2, "count");
    return Value::str(replace(need_str("replace"), to_str(a.get(0, "old")), to_str(a.get(1, "new")),
                              c.is_undefined() || c.is_none() ? -1 : c.as_int()));
  }
  if (f == "e" || f == "escape") return Value::str(html_escape(to_str(v)));
  if (f == "first" || f == "last") {
    List tmp;
    const List& l = need_list(v, f.c_str(), line, tmp);
    if (l.empty()) return Value();
    return f == "first" ? l.front() : l.back();
  }
  if (f == "list") {
    List tmp;
    return Value::make_list(need_list(v, "list", line, tmp));
  }
  if (f == "reverse") {
    if (v.is_str()) {
      std::u32string u = to_u32(v.s);
      std::reverse(u.begin(), u.end());
      return Value::str(from_u32(u));
    }
    List tmp;
    List l = need_list(v, "reverse", line, tmp);
    std::reverse(l.begin(), l.end());
    return Value::make_list(std::move(l));
  }
  if (f == "join") {
    List tmp;
    const List& l = need_list(v, "join", line, tmp);
    std::string sep = to_str(a.get(0, "d")), attr;
    const Value& at = a.get(1, "attribute");
    std::string r;
    for (size_t k = 0; k < l.size(); ++k) {
      if (k) r += sep;
      r += to_str(at.is_undefined() ? l[k] : attr_path(l[k], to_str(at)));
    }
    return Value::str(r);
  }
  if (f == "items") {
    if (v.is_undefined()) return Value::make_list();
    if (!v.is_dict()) err(line, "items: expected a mapping, got " + type_name(v));
    List l;
    for (const auto& [k, x] : v.dict->items) {
      l.push_back(Value::make_list({Value::str(k), x}));
      l.back().tuple = true;
    }
    return Value::make_list(std::move(l));
  }
  if (f == "int") {
    const Value& def = a.get(0, "default");
    Value d = def.is_undefined() ? Value::integer(0) : def;
    if (v.type == Value::Int || v.type == Value::Bool) return Value::integer(v.as_int());
    if (v.type == Value::Float) return Value::integer(int64_t(v.f));
    if (v.is_str()) {
      try {
        size_t pos;
        std::string t = strip(v.s, Value(), true, true);
        int64_t n = std::stoll(t, &pos, 10);
        if (pos == t.size()) return Value::integer(n);
        double x = std::stod(t, &pos);
        if (pos == t.size()) return Value::integer(int64_t(x));
      } catch (...) {
      }
    }
    return d;
  }
  if (f == "float") {
    if (v.is_number()) return Value::number(v.as_double());
    if (v.is_str()) {
      try {
        return Value::number(std::stod(v.s));
      } catch (...) {
      }
    }
    const Value& def = a.get(0, "default");
    return def.is_undefined() ? Value::number(0.0) : def;
  }
  if (f == "abs") {
    if (v.type == Value::Float) return Value::number(std::fabs(v.f));
    if (v.is_number()) return Value::integer(std::llabs(v.as_int()));
    err(line, "abs: expected a number");
  }
  if (f == "round") {
    int64_t prec = a.get(0, "precision").is_undefined() ? 0 : a.get(0, "precision").as_int();
    std::string method = a.get(1, "method").is_undefined() ? "common" : to_str(a.get(1, "method"));
    double m = std::pow(10.0, double(prec)), x = v.as_double() * m;
    x = method == "ceil" ? std::ceil(x) : method == "floor" ? std::floor(x) : std::round(x);
    return Value::number(x / m);
  }
  if (f == "unique") {
    List tmp, out;
    for (const auto& x : need_list(v, "unique", line, tmp))
      if (std::none_of(out.begin(), out.end(), [&](const Value& y) { return equals(x, y); })) out.push_back(x);
    return Value::make_list(std::move(out));
  }
  if (f == "sort") {
    List tmp;
    List l = need_list(v, "sort", line, tmp);
    bool rev = a.get(0, "reverse").truthy();
    const Value& at = a.get(2, "attribute");
    auto key = [&](const Value& x) { return at.is_undefined() ? x : attr_path(x, to_str(at)); };
    std::stable_sort(l.begin(), l.end(), [&](const Value& p, const Value& q) {
      int c = compare(key(p), key(q));
      return rev ? c > 0 : c < 0;
    });
    return Value::make_list(std::move(l));
  }
  if (f == "map") {
    List tmp, out;
    const List& l = need_list(v, "map", line, tmp);
    const Value& at = a.get(99, "attribute");
    if (!at.is_undefined()) {
      const Value& def = a.get(99, "default");
      for (const auto& x : l) {
        Value y = attr_path(x, to_str(at));
        out.push_back(y.is_undefined() && !def.is_undefined() ? def : y);
      }
    } else {
      std::string name = to_str(a.get(0, nullptr));
      Args rest = rest_args(a, 1);
      for (const auto& x : l) out.push_back(apply_filter(ip, name, x, rest, line));
    }
    return Value::make_list(std::move(out));
  }
  if (f == "select" || f == "reject" || f == "selectattr" || f == "rejectattr") {
    List tmp, out;
    const List& l = need_list(v, f.c_str(), line, tmp);
    bool by_attr = f == "selectattr" || f == "rejectattr";
    bool want = f == "select" || f == "selectattr";
    std::string attr = by_attr ? to_str(a.get(0, nullptr)) : "";
    size_t ti = by_attr ? 1 : 0;
    const Value& tn = a.get(ti, nullptr);
    Args rest = rest_args(a, ti + 1);
    for (const auto& x : l) {
      Value y = by_attr ? attr_path(x, attr) : x;
      bool r = tn.is_undefined() ? y.truthy() : apply_test(ip, to_str(tn), y, rest, line);
      if (r == want) out.push_back(x);
    }
    return Value::make_list(std::move(out));
  }
  if (f == "sum") {
    List tmp;
    const Value& at = a.get(0, "attribute");
    Value acc = a.get(1, "start").is_undefined() ? Value::integer(0) : a.get(1, "start");
    for (const auto& x : need_list(v, "sum", line, tmp)) {
      Value y = at.is_undefined() ? x : attr_path(x, to_str(at));
      if (!y.is_number() || !acc.is_number()) err(line, "sum: non-numeric value");
      if (acc.type == Value::Float || y.type == Value::Float) acc = Value::number(acc.as_double() + y.as_double());
      else acc = Value::integer(acc.as_int() + y.as_int());
    }
    return acc;
  }
  if (f == "max" || f == "min") {
    List tmp;
    const List& l = need_list(v, f.c_str(), line, tmp);
    if (l.empty()) return Value();
    Value best = l[0];
    for (const auto& x : l)
      if (f == "max" ? compare(x, best) > 0 : compare(x, best) < 0) best = x;
    return best;
  }
  if (f == "wordcount") return Value::integer(int64_t(split(to_str(v), Value(), -1).size()));
  if (f == "indent") {
    const Value& w = a.get(0, "width");
    int64_t width = w.is_undefined() ? 4 : std::clamp<int64_t>(w.as_int(), 0, 256);
    std::string pad = w.is_str() ? w.s : std::string(size_t(width), ' ');
    bool first = a.get(1, "first").truthy(), blank = a.get(2, "blank").truthy();
    std::string s = to_str(v), o;
    size_t pos = 0;
    bool is_first = true;
    while (true) {
      size_t e = s.find('\n', pos);
      std::string ln = s.substr(pos, e == std::string::npos ? std::string::npos : e - pos);
      if ((!is_first || first) && (blank || !ln.empty())) o += pad;
      o += ln;
      if (e == std::string::npos) break;
      o += '\n';
      pos = e + 1;
      is_first = false;
    }
    return Value::str(o);
  }
  if (f == "attr") return v.is_dict() ? attr_path(v, to_str(a.get(0, nullptr))) : Value();
  if (f == "dictsort") {
    if (!v.is_dict()) err(line, "dictsort: expected a mapping");
    List l;
    for (const auto& [k, x] : v.dict->items) l.push_back(Value::make_list({Value::str(k), x}));
    std::stable_sort(l.begin(), l.end(), [](const Value& p, const Value& q) {
      return (*p.list)[0].s < (*q.list)[0].s;
    });
    return Value::make_list(std::move(l));
  }
  (void)interp_lookup;
  err(line, "unsupported filter '" + f + "'");
}

Value make_global(const std::string& name) {
  if (name == "range") {
    return Value::func([](Args& a) {
      int64_t start = 0, stop, step = 1;
      if (a.pos.size() == 1) stop = a.pos[0].as_int();
      else if (a.pos.size() >= 2) { start = a.pos[0].as_int(); stop = a.pos[1].as_int(); if (a.pos.size() > 2) step = a.pos[2].as_int(); }
      else fail("chat template: range() needs arguments");
      if (step == 0) fail("chat template: range() step is zero");
      List l;
      for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
        l.push_back(Value::integer(i));
        if (l.size() > 1000000) fail("chat template: range() too long");
        if (step > 0 ? i > INT64_MAX - step : i < INT64_MIN - step) break;
      }
      charge(l.size());
      return Value::make_list(std::move(l));
    });
  }
  if (name == "namespace" || name == "dict") {
    bool ns = name == "namespace";
    return Value::func([ns](Args& a) {
      Dict d;
      for (const auto& p : a.pos) {
        if (!p.is_dict()) fail("chat template: ", ns ? "namespace" : "dict", "() takes keyword arguments");
        for (const auto& [k, v] : p.dict->items) d.set(k, v);
      }
      for (const auto& [k, v] : a.kw) d.set(k, v);
      Value r = Value::make_dict(std::move(d));
      r.ns = ns;
      return r;
    });
  }
  if (name == "raise_exception") {
    return Value::func([](Args& a) -> Value {
      fail("chat template raised an exception: ", to_str(a.get(0, "message")));
    });
  }
  if (name == "strftime_now") {
    return Value::func([](Args& a) {
      std::time_t t = std::time(nullptr);
      std::tm tm{};
      localtime_r(&t, &tm);
      char buf[256];
      size_t n = std::strftime(buf, sizeof buf, to_str(a.get(0, "format")).c_str(), &tm);
      return Value::str(std::string(buf, n));
    });
  }
  return Value();
}

}  // namespace spade::jinja
