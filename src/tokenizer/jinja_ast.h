// The syntax tree of a parsed Jinja template. Built once, then only read (renders share it).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tokenizer/jinja_value.h"

namespace recur::jinja {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class Kind {
    kLiteral,   // literal
    kName,      // name
    kList,      // children; flag = tuple
    kDict,      // children: key, value, key, value, ...
    kGetAttr,   // children[0].name
    kGetItem,   // children[0][children[1]]
    kSlice,     // children[0][children[1]:children[2]:children[3]], missing parts null
    kCall,      // children[0](args, kwargs)
    kFilter,    // children[0] | name(args, kwargs); children[0] null means "the block body"
    kTest,      // children[0] is [not] name(args, kwargs); flag = negated
    kUnary,     // name in {"not", "-", "+"}; children[0]
    kBinary,    // name in {"and", "or", "+", "-", "*", "/", "//", "%", "**", "~"}
    kCompare,   // children[0] ops[0] children[1] ops[1] children[2] ...
    kCondExpr,  // children: value if true, condition, value if false (may be null)
  };

  Kind kind = Kind::kLiteral;
  int line = 0;
  int column = 0;
  Value literal;
  std::string name;
  bool flag = false;
  std::vector<ExprPtr> children;
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  std::vector<std::string> ops;
};

struct Stmt;
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

// Left side of `set`, `for` or `with`: one name, a tuple of names, or namespace.attribute.
struct Target {
  std::vector<std::string> names;
  bool tuple = false;
  std::string attribute;  // non-empty: names[0].attribute on a namespace
};

struct Stmt {
  enum class Kind {
    kText,      // text
    kOutput,    // {{ expr }}
    kIf,        // branches (the last one's condition is null for else)
    kFor,       // for target in expr [if condition]: body [else else_body]
    kSet,       // set target = expr
    kSetBlock,  // set target [| filter chain in expr] %} body {% endset
    kMacro,     // macro name(params = defaults): body
    kBreak,
    kContinue,
    kFilterBlock,  // filter chain in expr: body
    kScope,        // with assignments: body; also {% generation %}
  };

  Kind kind = Kind::kText;
  int line = 0;
  int column = 0;
  std::string text;
  ExprPtr expr;
  ExprPtr condition;
  Target target;
  std::vector<std::pair<ExprPtr, Body>> branches;
  Body body;
  Body else_body;
  // kMacro
  std::string name;
  std::vector<std::string> params;
  std::vector<ExprPtr> defaults;  // one per param, null when it has none
  bool uses_varargs = false;
  bool uses_kwargs = false;
  // kScope
  std::vector<std::pair<std::string, ExprPtr>> assignments;
};

}  // namespace recur::jinja
