// Values of the Jinja subset interpreter, with Python semantics where templates rely on
// them: truthiness, ==, ordering, str() / repr() formatting, and json.dumps (as
// transformers' `tojson` filter calls it: ensure_ascii=False, key order kept).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace spade::jinja {

struct Value;
using List = std::vector<Value>;

// Insertion-ordered mapping (Python dicts keep insertion order, and so does tojson).
struct Dict {
  std::vector<std::pair<std::string, Value>> items;
  const Value* find(const std::string& k) const;
  Value* find(const std::string& k);
  void set(const std::string& k, Value v);
};

struct Args;
using Func = std::function<Value(Args&)>;

struct Value {
  enum Type { Undefined, None, Bool, Int, Float, Str, ListT, DictT, FuncT };
  Type type = Undefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;
  std::shared_ptr<List> list;
  std::shared_ptr<Dict> dict;  // also a namespace() object when `ns` is set
  std::shared_ptr<Func> fn;
  bool ns = false;
  bool tuple = false;  // a list that prints as a Python tuple

  Value() = default;
  static Value none() { Value v; v.type = None; return v; }
  static Value boolean(bool x) { Value v; v.type = Bool; v.b = x; return v; }
  static Value integer(int64_t x) { Value v; v.type = Int; v.i = x; return v; }
  static Value number(double x) { Value v; v.type = Float; v.f = x; return v; }
  static Value str(std::string x) { Value v; v.type = Str; v.s = std::move(x); return v; }
  static Value make_list(List l = {}) { Value v; v.type = ListT; v.list = std::make_shared<List>(std::move(l)); return v; }
  static Value make_dict(Dict d = {}) { Value v; v.type = DictT; v.dict = std::make_shared<Dict>(std::move(d)); return v; }
  static Value func(Func f) { Value v; v.type = FuncT; v.fn = std::make_shared<Func>(std::move(f)); return v; }

  bool is_undefined() const { return type == Undefined; }
  bool is_none() const { return type == None; }
  bool is_str() const { return type == Str; }
  bool is_list() const { return type == ListT; }
  bool is_dict() const { return type == DictT; }
  bool is_number() const { return type == Int || type == Float || type == Bool; }
  double as_double() const { return type == Float ? f : type == Bool ? double(b) : double(i); }
  int64_t as_int() const { return type == Bool ? int64_t(b) : type == Float ? int64_t(f) : i; }
  bool truthy() const;
  size_t length() const;  // strings: code points
};

struct Args {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
  // The argument at position `i` or named `name`, else undefined.
  const Value& get(size_t i, const char* name) const;
};

std::string type_name(const Value& v);
std::string to_str(const Value& v);   // Python str()
std::string repr(const Value& v);     // Python repr()
bool equals(const Value& a, const Value& b);
int compare(const Value& a, const Value& b);  // throws on unorderable types
// json.dumps(v, ensure_ascii=False, indent=indent (<0: none), separators default).
std::string to_json(const Value& v, int indent = -1, bool sort_keys = false);
Value from_json(const nlohmann::ordered_json& j);
std::string py_float(double d);  // Python repr of a float

}  // namespace spade::jinja
