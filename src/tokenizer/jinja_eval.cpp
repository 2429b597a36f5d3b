#include "tokenizer/jinja_eval.h"

#include <algorithm>
#include <new>

#include "tokenizer/jinja_ast.h"
#include "tokenizer/jinja_builtins.h"
#include "tokenizer/jinja_lexer.h"
#include "tokenizer/jinja_marked.h"
#include "tokenizer/jinja_parser.h"

namespace recur::jinja {

struct ParsedTemplate {
  std::string name;
  std::string source;
  Body body;
};

namespace {

constexpr int kMaxMacroDepth = 100;  // each level costs a dozen C++ frames
// The work of one render, in steps: a loop iteration or macro call is one; a list that a filter
// reads or an operator or global function makes costs one per item, a string one per 64 bytes.
// A chat of thousands of messages takes a few times its size; nested loops of 100,000 (each
// within the sandbox's range limit), or a loop over range(100000)|sum, would run for hours on
// an HTTP worker, and past shutdown.
constexpr int64_t kMaxRenderSteps = 5'000'000;

// Variables visible at one point: a frame of its own plus, read-only, everything enclosing.
class Scope {
 public:
  explicit Scope(const Scope* parent, const Dict* fixed = nullptr)
      : parent_(parent), fixed_(fixed) {}

  const Value* find(std::string_view name) const {
    for (const Scope* s = this; s; s = s->parent_) {
      if (const Value* v = s->vars_.find(name)) return v;
      if (s->fixed_) {
        if (const Value* v = s->fixed_->find(name)) return v;
      }
    }
    return nullptr;
  }
  void set(const std::string& name, Value v) { vars_.set(name, std::move(v)); }
  const Scope* parent() const { return parent_; }
  const Dict& own() const { return vars_; }

 private:
  const Scope* parent_;
  const Dict* fixed_;
  Dict vars_;
};

const Dict& builtin_globals() {
  static const Dict kGlobals = [] {
    Dict d;
    for (const std::string& name : global_function_names()) {
      auto fn = std::make_shared<Callable>();
      fn->kind = Callable::Kind::kGlobal;
      fn->name = name;
      d.set(name, Value::callable(std::move(fn)));
    }
    return d;
  }();
  return kGlobals;
}

enum class Flow { kNormal, kBreak, kContinue };

[[noreturn]] void rethrow_at(TemplateError& err, int line, int column) {
  if (!err.has_position) {
    err.message = fmt::format("line {}, column {}: {}", line, column, err.message);
    err.has_position = true;
  }
  throw;
}

class Renderer {
 public:
  explicit Renderer(const Dict& globals)
      : builtins_(nullptr, &builtin_globals()), globals_(&builtins_, &globals), root_(&globals_) {}

  MarkedText render(const Body& body) {
    MarkedText out;
    exec_body(body, root_, out);
    return out;
  }

 private:
  Scope builtins_;
  Scope globals_;
  Scope root_;  // the template's top level: its sets and macros
  int macro_depth_ = 0;
  int64_t steps_ = 0;  // the render's work so far (kMaxRenderSteps)

  void count_step(int64_t n = 1) {
    steps_ += n;
    if (steps_ > kMaxRenderSteps) {
      failf(ErrorCode::kInvalidArgument,
            "the template did more than {} steps of work (loop iterations, macro calls, items "
            "and bytes of the values it made) in one render: refused as runaway",
            kMaxRenderSteps);
    }
  }
  // What a value read or made costs: its items, or its bytes / 64.
  const Value& charge(const Value& v) {
    if (v.is_list()) count_step(int64_t(v.items().size()));
    if (v.is_string()) count_step(int64_t(v.str().size() / 64));
    return v;
  }

  Flow exec_body(const Body& body, Scope& scope, MarkedText& out) {
    for (const StmtPtr& s : body) {
      Flow f;
      try {
        f = exec(*s, scope, out);
      } catch (TemplateError& err) {
        rethrow_at(err, s->line, s->column);
      }
      if (f != Flow::kNormal) return f;
    }
    return Flow::kNormal;
  }

  void bind(const Target& t, const Value& v, Scope& scope) {
    if (!t.attribute.empty()) {
      const Value* ns = scope.find(t.names[0]);
      if (!ns || ns->type() != Value::Type::kNamespace) {
        fail(ErrorCode::kInvalidArgument, "cannot assign attribute on non-namespace object");
      }
      ns->ns().attrs.set(t.attribute, v);
      return;
    }
    if (!t.tuple) {
      scope.set(t.names[0], v);
      return;
    }
    auto items = iterate(v);
    if (items->size() != t.names.size()) {
      if (items->size() > t.names.size()) {
        failf(ErrorCode::kInvalidArgument, "too many values to unpack (expected {})",
              t.names.size());
      }
      failf(ErrorCode::kInvalidArgument, "not enough values to unpack (expected {}, got {})",
            t.names.size(), items->size());
    }
    for (size_t i = 0; i < items->size(); ++i) scope.set(t.names[i], (*items)[i]);
  }

  Flow exec(const Stmt& s, Scope& scope, MarkedText& out) {
    switch (s.kind) {
      case Stmt::Kind::kText:
        out.append(std::string_view(s.text));
        return Flow::kNormal;
      case Stmt::Kind::kOutput:
        out.append(eval(*s.expr, scope));
        return Flow::kNormal;
      case Stmt::Kind::kIf:
        for (const auto& [cond, body] : s.branches) {
          if (!cond || truthy(eval(*cond, scope))) return exec_body(body, scope, out);
        }
        return Flow::kNormal;
      case Stmt::Kind::kFor:
        return exec_for(s, scope, out);
      case Stmt::Kind::kSet:
        bind(s.target, eval(*s.expr, scope), scope);
        return Flow::kNormal;
      case Stmt::Kind::kSetBlock: {
        Scope inner(&scope);
        MarkedText captured;
        exec_body(s.body, inner, captured);
        Value v = captured.take();
        if (s.expr) v = eval_filters(*s.expr, scope, v);
        bind(s.target, v, scope);
        return Flow::kNormal;
      }
      case Stmt::Kind::kMacro: {
        auto fn = std::make_shared<Callable>();
        fn->kind = Callable::Kind::kMacro;
        fn->name = s.name;
        fn->macro = &s;
        if (&scope != &root_) fn->closure = std::make_shared<const Dict>(capture(scope));
        scope.set(s.name, Value::callable(std::move(fn)));
        return Flow::kNormal;
      }
      case Stmt::Kind::kBreak:
        return Flow::kBreak;
      case Stmt::Kind::kContinue:
        return Flow::kContinue;
      case Stmt::Kind::kFilterBlock: {
        Scope inner(&scope);
        MarkedText captured;
        exec_body(s.body, inner, captured);
        out.append(eval_filters(*s.expr, scope, captured.take()));
        return Flow::kNormal;
      }
      case Stmt::Kind::kScope: {
        std::vector<Value> values;
        for (const auto& [name, expr] : s.assignments) values.push_back(eval(*expr, scope));
        Scope inner(&scope);
        for (size_t i = 0; i < values.size(); ++i) inner.set(s.assignments[i].first, values[i]);
        return exec_body(s.body, inner, out);
      }
    }
    return Flow::kNormal;
  }

  // A snapshot of the frames between `scope` and the top level, innermost names winning; the
  // frames themselves end with their block while the macro may be called later.
  Dict capture(const Scope& scope) const {
    Dict vars;
    for (const Scope* s = &scope; s && s != &root_; s = s->parent()) {
      for (const auto& [name, value] : s->own().entries) {
        if (!vars.find(name)) vars.set(name, value);
      }
    }
    return vars;
  }

  Flow exec_for(const Stmt& s, Scope& scope, MarkedText& out) {
    std::shared_ptr<const List> items = iterate(eval(*s.expr, scope));
    if (s.condition) {
      List kept;
      for (const Value& item : *items) {
        count_step();
        Scope probe(&scope);
        bind(s.target, item, probe);
        if (truthy(eval(*s.condition, probe))) kept.push_back(item);
      }
      items = std::make_shared<const List>(std::move(kept));
    }
    if (items->empty()) {
      Scope inner(&scope);
      return exec_body(s.else_body, inner, out);
    }
    auto state = std::make_shared<LoopState>();
    state->items = items;
    Value loop = Value::loop(state);
    for (size_t i = 0; i < items->size(); ++i) {
      count_step();
      state->index0 = i;
      Scope iteration(&scope);  // each iteration starts from the enclosing variables
      iteration.set("loop", loop);
      bind(s.target, (*items)[i], iteration);
      if (exec_body(s.body, iteration, out) == Flow::kBreak) break;
    }
    return Flow::kNormal;
  }

  CallArgs eval_args(const Expr& e, const Scope& scope) {
    CallArgs args;
    for (const ExprPtr& a : e.args) args.positional.push_back(eval(*a, scope));
    for (const auto& [k, a] : e.kwargs) args.keyword.emplace_back(k, eval(*a, scope));
    return args;
  }

  // A filter chain whose innermost input is missing stands for `body` (filter/set blocks).
  Value eval_filters(const Expr& e, const Scope& scope, const Value& body) {
    if (e.kind != Expr::Kind::kFilter) return eval(e, scope);
    try {
      Value input = e.children[0] ? eval_filters(*e.children[0], scope, body) : body;
      charge(input);
      Value out = apply_filter(e.name, input, eval_args(e, scope));
      charge(out);
      return out;
    } catch (TemplateError& err) {
      rethrow_at(err, e.line, e.column);
    }
  }

  Value call(const Value& fn, const CallArgs& args) {
    if (fn.is_undefined()) fail_undefined(fn);
    if (fn.type() != Value::Type::kCallable) {
      failf(ErrorCode::kInvalidArgument, "'{}' object is not callable", type_name(fn));
    }
    const Callable& c = fn.fn();
    switch (c.kind) {
      case Callable::Kind::kGlobal: {
        Value out = call_global(c.name, args);
        charge(out);
        return out;
      }
      case Callable::Kind::kMacro:
        return call_macro(*static_cast<const Stmt*>(c.macro), c.closure.get(), args);
      case Callable::Kind::kMethod:
        return call_method(c.receiver, c.name, args);
      default:
        return call_loop_function(c, args);
    }
  }

  Value call_macro(const Stmt& m, const Dict* closure, const CallArgs& args) {
    count_step();
    if (macro_depth_ >= kMaxMacroDepth) {
      failf(ErrorCode::kInvalidArgument, "macro '{}' recursed more than {} levels", m.name,
            kMaxMacroDepth);
    }
    const size_t np = m.params.size();
    if (args.positional.size() > np && !m.uses_varargs) {
      failf(ErrorCode::kInvalidArgument, "macro '{}' takes not more than {} argument(s)", m.name,
            np);
    }
    Scope enclosing(&root_, closure);
    Scope scope(&enclosing);
    std::vector<bool> bound(np, false);
    List varargs;
    for (size_t i = 0; i < args.positional.size(); ++i) {
      if (i < np) {
        scope.set(m.params[i], args.positional[i]);
        bound[i] = true;
      } else {
        varargs.push_back(args.positional[i]);
      }
    }
    Dict kwargs;
    for (const auto& [k, v] : args.keyword) {
      auto it = std::find(m.params.begin(), m.params.end(), k);
      if (it == m.params.end()) {
        if (!m.uses_kwargs) {
          failf(ErrorCode::kInvalidArgument, "macro '{}' takes no keyword argument '{}'", m.name,
                k);
        }
        kwargs.set(k, v);
        continue;
      }
      size_t i = static_cast<size_t>(it - m.params.begin());
      if (bound[i]) {
        failf(ErrorCode::kInvalidArgument, "macro '{}' got multiple values for argument '{}'",
              m.name, k);
      }
      scope.set(k, v);
      bound[i] = true;
    }
    for (size_t i = 0; i < np; ++i) {
      if (bound[i]) continue;
      scope.set(m.params[i], m.defaults[i] ? eval(*m.defaults[i], scope)
                                           : Value::undefined(fmt::format(
                                                 "parameter '{}' was not provided", m.params[i])));
    }
    if (m.uses_varargs) scope.set("varargs", Value::list(std::move(varargs), ListKind::kTuple));
    if (m.uses_kwargs) scope.set("kwargs", Value::dict(std::move(kwargs)));
    MarkedText out;
    ++macro_depth_;
    try {
      exec_body(m.body, scope, out);
    } catch (...) {
      --macro_depth_;
      throw;
    }
    --macro_depth_;
    return out.take();
  }

  Value eval(const Expr& e, const Scope& scope) {
    try {
      return eval_unwrapped(e, scope);
    } catch (TemplateError& err) {
      rethrow_at(err, e.line, e.column);
    }
  }

  Value eval_unwrapped(const Expr& e, const Scope& scope) {
    switch (e.kind) {
      case Expr::Kind::kLiteral:
        return e.literal;
      case Expr::Kind::kName: {
        const Value* v = scope.find(e.name);
        return v ? *v : Value::undefined(fmt::format("'{}' is undefined", e.name));
      }
      case Expr::Kind::kList: {
        List items;
        items.reserve(e.children.size());
        for (const ExprPtr& c : e.children) items.push_back(eval(*c, scope));
        return Value::list(std::move(items), e.flag ? ListKind::kTuple : ListKind::kList);
      }
      case Expr::Kind::kDict: {
        Dict d;
        for (size_t i = 0; i + 1 < e.children.size(); i += 2) {
          Value key = eval(*e.children[i], scope);
          if (!key.is_string()) {
            fail(ErrorCode::kUnsupported, "dict literal keys other than strings are not supported");
          }
          if (key.user_spans()) d.keys_from_request = true;
          d.set(key.str(), eval(*e.children[i + 1], scope));
        }
        return Value::dict(std::move(d));
      }
      case Expr::Kind::kGetAttr:
        return get_attribute(eval(*e.children[0], scope), e.name);
      case Expr::Kind::kGetItem:
        return get_item(eval(*e.children[0], scope), eval(*e.children[1], scope));
      case Expr::Kind::kSlice: {
        Value obj = eval(*e.children[0], scope);
        Value parts[3];
        const Value* ptrs[3] = {nullptr, nullptr, nullptr};
        for (int i = 0; i < 3; ++i) {
          if (e.children[i + 1]) {
            parts[i] = eval(*e.children[i + 1], scope);
            ptrs[i] = &parts[i];
          }
        }
        return get_slice(obj, ptrs[0], ptrs[1], ptrs[2]);
      }
      case Expr::Kind::kCall: {
        Value fn = eval(*e.children[0], scope);
        return call(fn, eval_args(e, scope));
      }
      case Expr::Kind::kFilter:
        return eval_filters(e, scope, Value());
      case Expr::Kind::kTest: {
        Value subject = eval(*e.children[0], scope);
        bool r = apply_test(e.name, subject, eval_args(e, scope));
        return Value::boolean(e.flag ? !r : r);
      }
      case Expr::Kind::kUnary: {
        Value v = eval(*e.children[0], scope);
        if (e.name == "not") return Value::boolean(!truthy(v));
        return unary_op(e.name, v);
      }
      case Expr::Kind::kBinary: {
        Value a = eval(*e.children[0], scope);
        if (e.name == "and") return truthy(a) ? eval(*e.children[1], scope) : a;
        if (e.name == "or") return truthy(a) ? a : eval(*e.children[1], scope);
        Value b = eval(*e.children[1], scope);
        if (e.name == "~") {
          MarkedText joined;
          joined.append(a);
          joined.append(b);
          Value out = joined.take();
          charge(out);
          return out;
        }
        Value out = binary_op(e.name, a, b);
        charge(out);
        return out;
      }
      case Expr::Kind::kCompare: {
        Value left = eval(*e.children[0], scope);
        for (size_t i = 0; i < e.ops.size(); ++i) {
          Value right = eval(*e.children[i + 1], scope);
          if (!compare_op(e.ops[i], left, right)) return Value::boolean(false);
          left = std::move(right);
        }
        return Value::boolean(true);
      }
      case Expr::Kind::kCondExpr:
        if (truthy(eval(*e.children[1], scope))) return eval(*e.children[0], scope);
        if (e.children[2]) return eval(*e.children[2], scope);
        return Value::undefined(fmt::format(
            "the inline if-expression on line {} evaluated to false and no else section was "
            "defined.",
            e.line));
    }
    return Value();
  }
};

// e is `name`, `x.name`, `x['name']` or `x.get('name')`.
bool expr_names(const Expr* e, std::string_view name) {
  if (!e) return false;
  switch (e->kind) {
    case Expr::Kind::kName:
    case Expr::Kind::kGetAttr:
      return e->name == name;
    case Expr::Kind::kGetItem: {
      const Expr* key = e->children[1].get();
      return key && key->kind == Expr::Kind::kLiteral && key->literal.is_string() &&
             key->literal.str() == name;
    }
    case Expr::Kind::kCall: {
      const Expr* callee = e->children.empty() ? nullptr : e->children[0].get();
      return callee && callee->kind == Expr::Kind::kGetAttr && callee->name == "get" &&
             !e->args.empty() && e->args[0]->kind == Expr::Kind::kLiteral &&
             e->args[0]->literal.is_string() && e->args[0]->literal.str() == name;
    }
    default:
      return false;
  }
}

// Whether a for loop iterates over `name`, directly or through a variable set from it
// ({% set c = msg.get('content') %}{% for part in c %}), in template order.
bool body_loops_over(const Body& body, std::string_view name, std::vector<std::string>& aliases) {
  auto loops_over = [&](const Expr* e) {
    if (expr_names(e, name)) return true;
    return e && e->kind == Expr::Kind::kName &&
           std::find(aliases.begin(), aliases.end(), e->name) != aliases.end();
  };
  for (const StmtPtr& s : body) {
    if (s->kind == Stmt::Kind::kSet && s->target.names.size() == 1 && s->target.attribute.empty() &&
        expr_names(s->expr.get(), name)) {
      aliases.push_back(s->target.names[0]);
    }
    if (s->kind == Stmt::Kind::kFor && loops_over(s->expr.get())) return true;
    if (body_loops_over(s->body, name, aliases) || body_loops_over(s->else_body, name, aliases)) {
      return true;
    }
    for (const auto& [cond, b] : s->branches) {
      if (body_loops_over(b, name, aliases)) return true;
    }
  }
  return false;
}

Error to_error(const TemplateError& err, const std::string& name) {
  if (err.raised_by_template) return Error{err.code, err.message};
  return Error{err.code, (err.has_position ? name + " " : name + ": ") + err.message};
}

bool valid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    }
    i += n;
  }
  return true;
}

}  // namespace

Result<Template> Template::parse(std::string_view source, std::string name) {
  if (!valid_utf8(source)) {
    return make_error(ErrorCode::kInvalidArgument, "{}: not valid UTF-8", name);
  }
  auto parsed = std::make_shared<ParsedTemplate>();
  parsed->name = std::move(name);
  parsed->source = normalize_template_source(source);
  try {
    parsed->body = parse_tokens(tokenize(parsed->source));
  } catch (const TemplateError& err) {
    return to_error(err, parsed->name);
  }
  Template t;
  t.parsed_ = std::move(parsed);
  return t;
}

Result<std::string> Template::render(const Dict& globals) const {
  RECUR_ASSIGN_OR_RETURN(Rendered r, render_marked(globals));
  return std::move(r.text);
}

Result<Rendered> Template::render_marked(const Dict& globals) const {
  try {
    Renderer renderer(globals);
    MarkedText out = renderer.render(parsed_->body);
    Rendered r;
    r.request_spans = out.take_spans();
    r.text = out.take_text();
    return r;
  } catch (const TemplateError& err) {
    return to_error(err, parsed_->name);
  } catch (const std::bad_alloc&) {
    return make_error(ErrorCode::kOutOfResources, "{}: out of memory while rendering",
                      parsed_->name);
  }
}

bool Template::has_loop_over(std::string_view name) const {
  std::vector<std::string> aliases;
  return body_loops_over(parsed_->body, name, aliases);
}

}  // namespace recur::jinja
