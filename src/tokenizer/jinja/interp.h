// The Jinja subset interpreter: a parsed template rendered against a dictionary of
// variables, with the built-in filters, tests, string/dict methods and globals
// (range, namespace, dict, raise_exception, strftime_now) chat templates use.
#pragma once
#include <string>

#include "tokenizer/jinja/ast.h"

namespace spade::jinja {

class Template {
 public:
  explicit Template(const std::string& source);  // throws spade::Error on syntax errors
  std::string render(const Dict& vars) const;     // throws spade::Error on runtime errors

 private:
  Body body_;
};

class Interp;
// Built-ins (builtins.cpp). Each throws spade::Error for bad arguments.
Value apply_filter(Interp& ip, const std::string& name, const Value& v, const Args& args, int line);
bool apply_test(Interp& ip, const std::string& name, const Value& v, const Args& args, int line);
// Calls a str/dict method; false when `obj` has no such method.
bool call_method(const Value& obj, const std::string& name, const Args& args, Value& out, int line);
Value make_global(const std::string& name);  // range, namespace, dict, ...; undefined if none

// Work accounting for untrusted templates: every statement, loop iteration and element a
// built-in creates is charged; past the budget (50M) rendering fails with spade::Error.
void charge(uint64_t units);

// Python-style helpers shared by filters and methods.
std::u32string to_u32(const std::string& s);
std::string from_u32(const std::u32string& s);
bool py_isspace(char32_t c);

}  // namespace spade::jinja
