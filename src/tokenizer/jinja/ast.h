// Syntax tree of the Jinja subset: expressions and statements as the parser builds them.
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tokenizer/jinja/value.h"

namespace spade::jinja {

struct Expr;
using ExprP = std::unique_ptr<Expr>;

struct Expr {
  enum Kind {
    Literal, Name, Attr, Item, Slice, Call, Filter, Test, Unary, Binary, Cond, ListLit,
    TupleLit, DictLit,
  } kind;
  int line = 0;
  Value value;             // Literal
  std::string name;        // Name, Attr, Filter, Test; op for Unary/Binary
  ExprP a, b, c;           // operands: object/lhs, index/rhs, step / else
  std::vector<ExprP> args;                          // Call/Filter/Test args; list items
  std::vector<std::pair<std::string, ExprP>> kwargs;  // keyword args
  std::vector<std::pair<ExprP, ExprP>> pairs;       // DictLit
  bool negated = false;    // Test: "is not"
  Expr(Kind k, int l) : kind(k), line(l) {}
};

struct Stmt;
using StmtP = std::unique_ptr<Stmt>;
using Body = std::vector<StmtP>;

struct Stmt {
  enum Kind { Text, Output, If, For, Set, SetBlock, Macro, Break, Continue, CallBlock, FilterBlock } kind;
  int line = 0;
  std::string text;                          // Text
  ExprP expr;                                // Output, Set value, For iterable, call/filter expr
  std::vector<std::pair<ExprP, Body>> branches;  // If: (cond, body); For/Macro/...: body in [0]
  Body else_body;                            // If / For else
  std::vector<std::string> targets;          // For / Set names ("ns.attr" for namespace sets)
  ExprP filter;                              // For ... if cond
  std::string name;                          // Macro / SetBlock name
  std::vector<std::pair<std::string, ExprP>> params;  // Macro params (default may be null)
  Stmt(Kind k, int l) : kind(k), line(l) {}
};

}  // namespace spade::jinja
