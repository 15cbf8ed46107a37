#include "tokenizer/jinja/value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "core/error.h"

namespace spade::jinja {

namespace {
// Namespaces are mutable, so a value can contain itself; bound the recursion.
thread_local int t_depth = 0;
struct Nest {
  Nest() {
    if (++t_depth > 100) {
      --t_depth;
      fail("chat template: value nested too deeply (or containing itself)");
    }
  }
  ~Nest() { --t_depth; }
};
}  // namespace

const Value* Dict::find(const std::string& k) const {
  for (const auto& [key, v] : items)
    if (key == k) return &v;
  return nullptr;
}
Value* Dict::find(const std::string& k) {
  for (auto& [key, v] : items)
    if (key == k) return &v;
  return nullptr;
}
void Dict::set(const std::string& k, Value v) {
  if (Value* p = find(k))
    *p = std::move(v);
  else
    items.emplace_back(k, std::move(v));
}

const Value& Args::get(size_t i, const char* name) const {
  static const Value undef;
  if (name)
    for (const auto& [k, v] : kw)
      if (k == name) return v;
  return i < pos.size() ? pos[i] : undef;
}

bool Value::truthy() const {
  switch (type) {
    case Undefined: case None: return false;
    case Bool: return b;
    case Int: return i != 0;
    case Float: return f != 0;
    case Str: return !s.empty();
    case ListT: return !list->empty();
    case DictT: return ns || !dict->items.empty();
    case FuncT: return true;
  }
  return false;
}

size_t Value::length() const {
  switch (type) {
    case Str: {
      size_t n = 0;
      for (unsigned char c : s) n += (c & 0xC0) != 0x80;
      return n;
    }
    case ListT: return list->size();
    case DictT: return dict->items.size();
    default: return 0;
  }
}

std::string type_name(const Value& v) {
  switch (v.type) {
    case Value::Undefined: return "undefined";
    case Value::None: return "none";
    case Value::Bool: return "bool";
    case Value::Int: return "int";
    case Value::Float: return "float";
    case Value::Str: return "string";
    case Value::ListT: return "list";
    case Value::DictT: return v.ns ? "namespace" : "dict";
    case Value::FuncT: return "function";
  }
  return "?";
}

std::string py_float(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  if (d == 0) return std::signbit(d) ? "-0.0" : "0.0";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific);
  std::string sci(buf, r.ptr);
  bool neg = sci[0] == '-';
  if (neg) sci.erase(0, 1);
  size_t epos = sci.find('e');
  std::string mant = sci.substr(0, epos);
  int exp = std::stoi(sci.substr(epos + 1));
  std::string digits;
  for (char c : mant)
    if (c != '.') digits += c;
  std::string out;
  if (exp >= -4 && exp < 16) {
    if (exp < 0) {
      out = "0." + std::string(size_t(-exp - 1), '0') + digits;
    } else if (size_t(exp + 1) >= digits.size()) {
      out = digits + std::string(size_t(exp + 1) - digits.size(), '0') + ".0";
    } else {
      out = digits.substr(0, exp + 1) + "." + digits.substr(exp + 1);
    }
  } else {
    out = mant + (exp < 0 ? "e-" : "e+") + (std::abs(exp) < 10 ? "0" : "") +
          std::to_string(std::abs(exp));
  }
  return neg ? "-" + out : out;
}

namespace {

std::string py_str_repr(const std::string& s) {
  char q = (s.find('\'') != std::string::npos && s.find('"') == std::string::npos) ? '"' : '\'';
  std::string o(1, q);
  for (unsigned char c : s) {
    if (c == '\\') o += "\\\\";
    else if (c == q) { o += '\\'; o += char(c); }
    else if (c == '\n') o += "\\n";
    else if (c == '\r') o += "\\r";
    else if (c == '\t') o += "\\t";
    else if (c < 0x20 || c == 0x7F) {
      char b[8];
      std::snprintf(b, sizeof b, "\\x%02x", c);
      o += b;
    } else o += char(c);
  }
  o += q;
  return o;
}

void json_str(std::string& o, const std::string& s) {
  o += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"': o += "\\\""; break;
      case '\\': o += "\\\\"; break;
      case '\n': o += "\\n"; break;
      case '\r': o += "\\r"; break;
      case '\t': o += "\\t"; break;
      case '\b': o += "\\b"; break;
      case '\f': o += "\\f"; break;
      default:
        if (c < 0x20) {
          char b[8];
          std::snprintf(b, sizeof b, "\\u%04x", c);
          o += b;
        } else {
          o += char(c);
        }
    }
  }
  o += '"';
}

void json_rec(std::string& o, const Value& v, int indent, int level, bool sort_keys) {
  Nest nest;
  auto nl = [&](int lv) {
    if (indent < 0) return;
    o += '\n';
    o.append(size_t(indent * lv), ' ');
  };
  const char* item_sep = indent < 0 ? ", " : ",";
  switch (v.type) {
    case Value::None: o += "null"; break;
    case Value::Bool: o += v.b ? "true" : "false"; break;
    case Value::Int: o += std::to_string(v.i); break;
    case Value::Float:
      o += std::isnan(v.f) ? "NaN" : std::isinf(v.f) ? (v.f < 0 ? "-Infinity" : "Infinity") : py_float(v.f);
      break;
    case Value::Str: json_str(o, v.s); break;
    case Value::ListT:
      if (v.list->empty()) { o += "[]"; break; }
      o += '[';
      for (size_t k = 0; k < v.list->size(); ++k) {
        if (k) o += item_sep;
        nl(level + 1);
        json_rec(o, (*v.list)[k], indent, level + 1, sort_keys);
      }
      nl(level);
      o += ']';
      break;
    case Value::DictT: {
      if (v.dict->items.empty()) { o += "{}"; break; }
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& it : v.dict->items) items.push_back(&it);
      if (sort_keys)
        std::sort(items.begin(), items.end(), [](auto* a, auto* b) { return a->first < b->first; });
      o += '{';
      for (size_t k = 0; k < items.size(); ++k) {
        if (k) o += item_sep;
        nl(level + 1);
        json_str(o, items[k]->first);
        o += ": ";
        json_rec(o, items[k]->second, indent, level + 1, sort_keys);
      }
      nl(level);
      o += '}';
      break;
    }
    case Value::Undefined:
      fail("tojson: Object of type Undefined is not JSON serializable");
    case Value::FuncT:
      fail("tojson: a function is not JSON serializable");
  }
}

}  // namespace

std::string repr(const Value& v) {
  Nest nest;
  switch (v.type) {
    case Value::Str: return py_str_repr(v.s);
    case Value::ListT: {
      std::string o = v.tuple ? "(" : "[";
      for (size_t k = 0; k < v.list->size(); ++k) {
        if (k) o += ", ";
        o += repr((*v.list)[k]);
      }
      if (v.tuple && v.list->size() == 1) o += ",";
      return o + (v.tuple ? ")" : "]");
    }
    case Value::DictT: {
      std::string o = v.ns ? "<Namespace {" : "{";
      bool first = true;
      for (const auto& [k, x] : v.dict->items) {
        if (!first) o += ", ";
        first = false;
        o += py_str_repr(k) + ": " + repr(x);
      }
      return o + (v.ns ? "}>" : "}");
    }
    default: return to_str(v);
  }
}

std::string to_str(const Value& v) {
  switch (v.type) {
    case Value::Undefined: return "";
    case Value::None: return "None";
    case Value::Bool: return v.b ? "True" : "False";
    case Value::Int: return std::to_string(v.i);
    case Value::Float: return py_float(v.f);
    case Value::Str: return v.s;
    case Value::FuncT: return "<function>";
    default: return repr(v);
  }
}

bool equals(const Value& a, const Value& b) {
  Nest nest;
  if (a.is_number() && b.is_number()) {
    if (a.type == Value::Float || b.type == Value::Float) return a.as_double() == b.as_double();
    return a.as_int() == b.as_int();
  }
  if (a.type != b.type) return false;
  switch (a.type) {
    case Value::Undefined: case Value::None: return true;
    case Value::Str: return a.s == b.s;
    case Value::ListT:
      if (a.list->size() != b.list->size()) return false;
      for (size_t k = 0; k < a.list->size(); ++k)
        if (!equals((*a.list)[k], (*b.list)[k])) return false;
      return true;
    case Value::DictT:
      if (a.ns || b.ns) return a.dict == b.dict;
      if (a.dict->items.size() != b.dict->items.size()) return false;
      for (const auto& [k, x] : a.dict->items) {
        const Value* y = b.dict->find(k);
        if (!y || !equals(x, *y)) return false;
      }
      return true;
    case Value::FuncT: return a.fn == b.fn;
    default: return false;
  }
}

int compare(const Value& a, const Value& b) {
  Nest nest;
  if (a.is_number() && b.is_number()) {
    double x = a.as_double(), y = b.as_double();
    if (a.type != Value::Float && b.type != Value::Float) {
      int64_t p = a.as_int(), q = b.as_int();
      return p < q ? -1 : p > q ? 1 : 0;
    }
    return x < y ? -1 : x > y ? 1 : 0;
  }
  if (a.is_str() && b.is_str()) return a.s < b.s ? -1 : a.s > b.s ? 1 : 0;
  if (a.is_list() && b.is_list()) {
    for (size_t k = 0; k < a.list->size() && k < b.list->size(); ++k)
      if (int c = compare((*a.list)[k], (*b.list)[k])) return c;
    return a.list->size() < b.list->size() ? -1 : a.list->size() > b.list->size() ? 1 : 0;
  }
  fail("'<' not supported between ", type_name(a), " and ", type_name(b));
}

std::string to_json(const Value& v, int indent, bool sort_keys) {
  std::string o;
  json_rec(o, v, indent, 0, sort_keys);
  return o;
}

Value from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null: return Value::none();
    case nlohmann::ordered_json::value_t::boolean: return Value::boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer: return Value::integer(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: return Value::integer(int64_t(j.get<uint64_t>()));
    case nlohmann::ordered_json::value_t::number_float: return Value::number(j.get<double>());
    case nlohmann::ordered_json::value_t::string: return Value::str(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      List l;
      for (const auto& x : j) l.push_back(from_json(x));
      return Value::make_list(std::move(l));
    }
    case nlohmann::ordered_json::value_t::object: {
      Dict d;
      for (auto it = j.begin(); it != j.end(); ++it) d.items.emplace_back(it.key(), from_json(it.value()));
      return Value::make_dict(std::move(d));
    }
    default: return Value();
  }
}

}  // namespace spade::jinja
