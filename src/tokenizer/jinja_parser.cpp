#include "tokenizer/jinja_parser.h"

#include <algorithm>
#include <initializer_list>
#include <set>

#include "tokenizer/jinja_builtins.h"

namespace recur::jinja {

namespace {

// Deeper nesting of blocks or expressions is refused instead of overflowing the stack.
constexpr int kMaxParseNesting = 256;

class Parser {
 public:
  explicit Parser(const std::vector<Token>& tokens) : toks_(tokens) {}

  Body parse_template() { return parse_body({}); }

 private:
  const std::vector<Token>& toks_;
  size_t i_ = 0;
  int loop_depth_ = 0;
  int nesting_ = 0;
  std::vector<std::set<std::string>*> name_sinks_;  // names referenced inside open macros

  class Nesting {
   public:
    explicit Nesting(Parser& p) : p_(p) {
      if (++p_.nesting_ > kMaxParseNesting) {
        --p_.nesting_;
        p_.error(p_.cur(), "template nested too deeply");
      }
    }
    ~Nesting() { --p_.nesting_; }

   private:
    Parser& p_;
  };

  const Token& cur() const { return toks_[i_]; }
  const Token& peek(size_t n) const { return toks_[std::min(i_ + n, toks_.size() - 1)]; }
  void advance() {
    if (i_ + 1 < toks_.size()) ++i_;
  }

  [[noreturn]] void error(const Token& t, const std::string& message) const {
    throw TemplateError{ErrorCode::kInvalidArgument,
                        fmt::format("line {}, column {}: {}", t.line, t.column, message), true};
  }
  [[noreturn]] void unsupported(const Token& t, const std::string& what) const {
    throw TemplateError{
        ErrorCode::kUnsupported,
        fmt::format("line {}, column {}: {} is not supported", t.line, t.column, what), true};
  }

  static std::string describe(const Token& t) {
    switch (t.type) {
      case TokenType::kText:
        return "template text";
      case TokenType::kVarBegin:
        return "'{{'";
      case TokenType::kVarEnd:
        return "'}}'";
      case TokenType::kBlockBegin:
        return "'{%'";
      case TokenType::kBlockEnd:
        return "'%}'";
      case TokenType::kString:
        return "string literal";
      case TokenType::kInt:
      case TokenType::kFloat:
        return "number '" + t.text + "'";
      case TokenType::kEof:
        return "end of template";
      default:
        return "'" + t.text + "'";
    }
  }

  bool is_op(std::string_view op) const {
    return cur().type == TokenType::kOperator && cur().text == op;
  }
  bool is_name(std::string_view name) const {
    return cur().type == TokenType::kName && cur().text == name;
  }
  void expect_op(std::string_view op) {
    if (!is_op(op)) error(cur(), fmt::format("expected '{}', got {}", op, describe(cur())));
    advance();
  }
  std::string expect_name() {
    if (cur().type != TokenType::kName) error(cur(), "expected a name, got " + describe(cur()));
    std::string n = cur().text;
    advance();
    return n;
  }
  void expect_block_end() {
    if (cur().type != TokenType::kBlockEnd) {
      error(cur(), "expected end of tag '%}', got " + describe(cur()));
    }
    advance();
  }

  ExprPtr make_expr(Expr::Kind kind, const Token& at) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = at.line;
    e->column = at.column;
    return e;
  }
  StmtPtr make_stmt(Stmt::Kind kind, const Token& at) {
    auto s = std::make_unique<Stmt>();
    s->kind = kind;
    s->line = at.line;
    s->column = at.column;
    return s;
  }

  // ---- statements ----

  // Parses until a block tag named in `ends` (left unconsumed) or the end of the template.
  Body parse_body(std::initializer_list<std::string_view> ends) {
    Body body;
    while (true) {
      const Token& t = cur();
      switch (t.type) {
        case TokenType::kText: {
          auto s = make_stmt(Stmt::Kind::kText, t);
          s->text = t.text;
          body.push_back(std::move(s));
          advance();
          break;
        }
        case TokenType::kVarBegin: {
          auto s = make_stmt(Stmt::Kind::kOutput, t);
          advance();
          s->expr = parse_tuple(true, false);
          if (cur().type != TokenType::kVarEnd) {
            error(cur(), "expected end of print statement '}}', got " + describe(cur()));
          }
          advance();
          body.push_back(std::move(s));
          break;
        }
        case TokenType::kBlockBegin: {
          const Token& name = peek(1);
          if (name.type != TokenType::kName) error(name, "expected a tag name after '{%'");
          if (std::find(ends.begin(), ends.end(), name.text) != ends.end()) return body;
          body.push_back(parse_statement());
          break;
        }
        case TokenType::kEof:
          if (ends.size() != 0) {
            error(t, fmt::format("unexpected end of template, expected '{{% {} %}}'",
                                 *(ends.end() - 1)));
          }
          return body;
        default:
          error(t, "unexpected " + describe(t));
      }
    }
  }

  // Consumes "{% name" of an end or middle tag and returns the name.
  std::string consume_tag_name() {
    advance();
    return expect_name();
  }

  StmtPtr parse_statement() {
    Nesting nesting(*this);
    const Token& open = cur();
    advance();
    const Token& tag = cur();
    const std::string name = tag.text;
    advance();
    if (name == "for") return parse_for(open);
    if (name == "if") return parse_if(open);
    if (name == "set") return parse_set(open);
    if (name == "macro") return parse_macro(open);
    if (name == "filter") return parse_filter_block(open);
    if (name == "with") return parse_with(open);
    if (name == "generation") return parse_generation(open);
    if (name == "break" || name == "continue") {
      if (loop_depth_ == 0) error(tag, fmt::format("'{}' outside of a loop", name));
      expect_block_end();
      return make_stmt(name == "break" ? Stmt::Kind::kBreak : Stmt::Kind::kContinue, open);
    }
    static const std::set<std::string, std::less<>> kUnsupported = {
        "call", "block", "extends", "include", "import", "from", "autoescape", "do", "trans"};
    if (kUnsupported.count(name)) unsupported(tag, fmt::format("the '{{% {} %}}' tag", name));
    static const std::set<std::string, std::less<>> kStray = {
        "endfor",   "endif",     "elif",    "else",          "endset",
        "endmacro", "endfilter", "endwith", "endgeneration", "endraw"};
    if (kStray.count(name)) error(tag, fmt::format("unexpected '{{% {} %}}'", name));
    error(tag, fmt::format("unknown tag '{}'", name));
  }

  Target parse_target(bool allow_attribute) {
    Target t;
    bool parens = is_op("(");
    if (parens) advance();
    t.names.push_back(expect_name());
    if (allow_attribute && !parens && is_op(".")) {
      advance();
      t.attribute = expect_name();
      return t;
    }
    while (is_op(",")) {
      advance();
      t.tuple = true;
      if (cur().type != TokenType::kName) break;  // trailing comma
      t.names.push_back(expect_name());
    }
    if (parens) {
      expect_op(")");
      t.tuple = true;
    }
    return t;
  }

  StmtPtr parse_for(const Token& open) {
    auto s = make_stmt(Stmt::Kind::kFor, open);
    s->target = parse_target(false);
    if (!is_name("in")) error(cur(), "expected 'in' in for loop, got " + describe(cur()));
    advance();
    s->expr = parse_tuple(false, false);
    if (is_name("if")) {
      advance();
      s->condition = parse_expression(true);
    }
    if (is_name("recursive")) unsupported(cur(), "a recursive for loop");
    expect_block_end();
    ++loop_depth_;
    s->body = parse_body({"endfor", "else"});
    --loop_depth_;
    if (consume_tag_name() == "else") {
      expect_block_end();
      s->else_body = parse_body({"endfor"});
      consume_tag_name();
    }
    expect_block_end();
    return s;
  }

  StmtPtr parse_if(const Token& open) {
    auto s = make_stmt(Stmt::Kind::kIf, open);
    ExprPtr cond = parse_tuple(false, false);
    expect_block_end();
    while (true) {
      Body body = parse_body({"elif", "else", "endif"});
      s->branches.emplace_back(std::move(cond), std::move(body));
      std::string tag = consume_tag_name();
      if (tag == "elif") {
        cond = parse_tuple(false, false);
        expect_block_end();
      } else if (tag == "else") {
        expect_block_end();
        s->branches.emplace_back(nullptr, parse_body({"endif"}));
        consume_tag_name();
        expect_block_end();
        return s;
      } else {
        expect_block_end();
        return s;
      }
    }
  }

  StmtPtr parse_set(const Token& open) {
    Target target = parse_target(true);
    if (is_op("=")) {
      auto s = make_stmt(Stmt::Kind::kSet, open);
      s->target = std::move(target);
      advance();
      s->expr = parse_tuple(true, false);
      expect_block_end();
      return s;
    }
    auto s = make_stmt(Stmt::Kind::kSetBlock, open);
    s->target = std::move(target);
    if (is_op("|")) s->expr = parse_filter_chain(nullptr);
    expect_block_end();
    s->body = parse_body({"endset"});
    consume_tag_name();
    expect_block_end();
    return s;
  }

  StmtPtr parse_macro(const Token& open) {
    auto s = make_stmt(Stmt::Kind::kMacro, open);
    s->name = expect_name();
    expect_op("(");
    while (!is_op(")")) {
      if (!s->params.empty()) expect_op(",");
      if (is_op(")")) break;
      const Token& at = cur();
      s->params.push_back(expect_name());
      if (is_op("=")) {
        advance();
        s->defaults.push_back(parse_expression(true));
      } else {
        if (!s->defaults.empty() && s->defaults.back()) {
          error(at, "non-default argument follows default argument");
        }
        s->defaults.push_back(nullptr);
      }
    }
    advance();
    expect_block_end();
    std::set<std::string> referenced;
    name_sinks_.push_back(&referenced);
    int saved_depth = loop_depth_;
    loop_depth_ = 0;
    s->body = parse_body({"endmacro"});
    loop_depth_ = saved_depth;
    name_sinks_.pop_back();
    if (referenced.count("caller")) unsupported(open, "'caller' in a macro (call blocks)");
    s->uses_varargs = referenced.count("varargs") > 0;
    s->uses_kwargs = referenced.count("kwargs") > 0;
    consume_tag_name();
    expect_block_end();
    return s;
  }

  StmtPtr parse_filter_block(const Token& open) {
    auto s = make_stmt(Stmt::Kind::kFilterBlock, open);
    s->expr = parse_filter_chain(nullptr, /*leading_pipe=*/false);
    expect_block_end();
    s->body = parse_body({"endfilter"});
    consume_tag_name();
    expect_block_end();
    return s;
  }

  StmtPtr parse_with(const Token& open) {
    auto s = make_stmt(Stmt::Kind::kScope, open);
    while (cur().type != TokenType::kBlockEnd) {
      if (!s->assignments.empty()) expect_op(",");
      std::string name = expect_name();
      expect_op("=");
      s->assignments.emplace_back(std::move(name), parse_expression(true));
    }
    expect_block_end();
    s->body = parse_body({"endwith"});
    consume_tag_name();
    expect_block_end();
    return s;
  }

  // transformers' {% generation %} marks assistant text for masks; it renders its body.
  StmtPtr parse_generation(const Token& open) {
    auto s = make_stmt(Stmt::Kind::kScope, open);
    expect_block_end();
    s->body = parse_body({"endgeneration"});
    consume_tag_name();
    expect_block_end();
    return s;
  }

  // ---- expressions ----

  bool at_tuple_end() const {
    return cur().type == TokenType::kVarEnd || cur().type == TokenType::kBlockEnd || is_op(")") ||
           cur().type == TokenType::kEof;
  }

  ExprPtr parse_tuple(bool with_condexpr, bool explicit_parens) {
    const Token& start = cur();
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) {
        if (!is_op(",")) break;
        advance();
        is_tuple = true;
      }
      if (at_tuple_end()) break;
      items.push_back(parse_expression(with_condexpr));
      if (!is_op(",")) break;
    }
    if (!is_tuple && items.size() == 1) return std::move(items[0]);
    if (items.empty() && !explicit_parens)
      error(cur(), "expected an expression, got " + describe(cur()));
    auto e = make_expr(Expr::Kind::kList, start);
    e->flag = true;
    e->children = std::move(items);
    return e;
  }

  ExprPtr parse_expression(bool with_condexpr) {
    Nesting nesting(*this);
    return with_condexpr ? parse_condexpr() : parse_or();
  }

  ExprPtr parse_condexpr() {
    ExprPtr e = parse_or();
    while (is_name("if")) {
      auto c = make_expr(Expr::Kind::kCondExpr, cur());
      advance();
      ExprPtr cond = parse_or();
      ExprPtr otherwise;
      if (is_name("else")) {
        advance();
        otherwise = parse_condexpr();
      }
      c->children.push_back(std::move(e));
      c->children.push_back(std::move(cond));
      c->children.push_back(std::move(otherwise));
      e = std::move(c);
    }
    return e;
  }

  ExprPtr binary(const Token& at, std::string op, ExprPtr l, ExprPtr r) {
    auto e = make_expr(Expr::Kind::kBinary, at);
    e->name = std::move(op);
    e->children.push_back(std::move(l));
    e->children.push_back(std::move(r));
    return e;
  }

  ExprPtr parse_or() {
    ExprPtr e = parse_and();
    while (is_name("or")) {
      const Token& at = cur();
      advance();
      e = binary(at, "or", std::move(e), parse_and());
    }
    return e;
  }

  ExprPtr parse_and() {
    ExprPtr e = parse_not();
    while (is_name("and")) {
      const Token& at = cur();
      advance();
      e = binary(at, "and", std::move(e), parse_not());
    }
    return e;
  }

  ExprPtr parse_not() {
    Nesting nesting(*this);
    if (is_name("not")) {
      auto e = make_expr(Expr::Kind::kUnary, cur());
      e->name = "not";
      advance();
      e->children.push_back(parse_not());
      return e;
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    const Token& start = cur();
    ExprPtr first = parse_math1();
    std::vector<std::string> ops;
    std::vector<ExprPtr> rest;
    while (true) {
      static const char* const kCompareOps[] = {"==", "!=", "<", ">", "<=", ">="};
      bool matched = false;
      for (const char* op : kCompareOps) {
        if (is_op(op)) {
          ops.push_back(op);
          matched = true;
          break;
        }
      }
      if (matched) {
        advance();
      } else if (is_name("in")) {
        ops.push_back("in");
        advance();
      } else if (is_name("not") && peek(1).type == TokenType::kName && peek(1).text == "in") {
        ops.push_back("not in");
        advance();
        advance();
      } else {
        break;
      }
      rest.push_back(parse_math1());
    }
    if (ops.empty()) return first;
    auto e = make_expr(Expr::Kind::kCompare, start);
    e->children.push_back(std::move(first));
    for (auto& r : rest) e->children.push_back(std::move(r));
    e->ops = std::move(ops);
    return e;
  }

  ExprPtr parse_math1() {
    ExprPtr e = parse_concat();
    while (is_op("+") || is_op("-")) {
      const Token& at = cur();
      advance();
      e = binary(at, at.text, std::move(e), parse_concat());
    }
    return e;
  }

  ExprPtr parse_concat() {
    ExprPtr e = parse_math2();
    while (is_op("~")) {
      const Token& at = cur();
      advance();
      e = binary(at, "~", std::move(e), parse_math2());
    }
    return e;
  }

  ExprPtr parse_math2() {
    ExprPtr e = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const Token& at = cur();
      advance();
      e = binary(at, at.text, std::move(e), parse_pow());
    }
    return e;
  }

  ExprPtr parse_pow() {
    ExprPtr e = parse_unary(true);
    while (is_op("**")) {
      const Token& at = cur();
      advance();
      e = binary(at, "**", std::move(e), parse_unary(true));
    }
    return e;
  }

  ExprPtr parse_unary(bool with_filter) {
    Nesting nesting(*this);
    ExprPtr e;
    if (is_op("-") || is_op("+")) {
      e = make_expr(Expr::Kind::kUnary, cur());
      e->name = cur().text;
      advance();
      e->children.push_back(parse_unary(false));
    } else {
      e = parse_primary();
    }
    e = parse_postfix(std::move(e));
    if (with_filter) e = parse_filter_expr(std::move(e));
    return e;
  }

  ExprPtr parse_primary() {
    const Token& t = cur();
    switch (t.type) {
      case TokenType::kName: {
        advance();
        if (t.text == "true" || t.text == "True" || t.text == "false" || t.text == "False") {
          auto e = make_expr(Expr::Kind::kLiteral, t);
          e->literal = Value::boolean(t.text[0] == 't' || t.text[0] == 'T');
          return e;
        }
        if (t.text == "none" || t.text == "None") {
          auto e = make_expr(Expr::Kind::kLiteral, t);
          e->literal = Value::none();
          return e;
        }
        for (auto* sink : name_sinks_) sink->insert(t.text);
        auto e = make_expr(Expr::Kind::kName, t);
        e->name = t.text;
        return e;
      }
      case TokenType::kString: {
        std::string s;
        while (cur().type == TokenType::kString) {  // adjacent literals concatenate
          s += cur().text;
          advance();
        }
        auto e = make_expr(Expr::Kind::kLiteral, t);
        e->literal = Value::string(std::move(s));
        return e;
      }
      case TokenType::kInt:
      case TokenType::kFloat: {
        advance();
        auto e = make_expr(Expr::Kind::kLiteral, t);
        e->literal = t.type == TokenType::kInt ? Value::integer(t.int_value)
                                               : Value::floating(t.float_value);
        return e;
      }
      case TokenType::kOperator:
        if (t.text == "(") {
          advance();
          ExprPtr e = parse_tuple(true, true);
          expect_op(")");
          return e;
        }
        if (t.text == "[") return parse_list();
        if (t.text == "{") return parse_dict();
        [[fallthrough]];
      default:
        error(t, "unexpected " + describe(t));
    }
  }

  ExprPtr parse_list() {
    auto e = make_expr(Expr::Kind::kList, cur());
    advance();
    while (!is_op("]")) {
      if (!e->children.empty()) {
        expect_op(",");
        if (is_op("]")) break;
      }
      e->children.push_back(parse_expression(true));
    }
    advance();
    return e;
  }

  ExprPtr parse_dict() {
    auto e = make_expr(Expr::Kind::kDict, cur());
    advance();
    while (!is_op("}")) {
      if (!e->children.empty()) {
        expect_op(",");
        if (is_op("}")) break;
      }
      e->children.push_back(parse_expression(true));
      expect_op(":");
      e->children.push_back(parse_expression(true));
    }
    advance();
    return e;
  }

  ExprPtr parse_postfix(ExprPtr e) {
    while (true) {
      if (is_op(".")) {
        const Token& at = cur();
        advance();
        if (cur().type == TokenType::kName) {
          auto g = make_expr(Expr::Kind::kGetAttr, at);
          g->name = cur().text;
          g->children.push_back(std::move(e));
          e = std::move(g);
        } else if (cur().type == TokenType::kInt) {
          auto g = make_expr(Expr::Kind::kGetItem, at);
          auto idx = make_expr(Expr::Kind::kLiteral, cur());
          idx->literal = Value::integer(cur().int_value);
          g->children.push_back(std::move(e));
          g->children.push_back(std::move(idx));
          e = std::move(g);
        } else {
          error(cur(), "expected an attribute name after '.', got " + describe(cur()));
        }
        advance();
      } else if (is_op("[")) {
        e = parse_subscript(std::move(e));
      } else if (is_op("(")) {
        e = parse_call(std::move(e));
      } else {
        return e;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr target) {
    const Token& at = cur();
    advance();
    std::vector<ExprPtr> parts;
    bool is_slice = false;
    auto optional_expr = [&]() -> ExprPtr {
      if (is_op(":") || is_op("]")) return nullptr;
      return parse_expression(true);
    };
    parts.push_back(optional_expr());
    if (is_op(":")) {
      is_slice = true;
      advance();
      parts.push_back(optional_expr());
      if (is_op(":")) {
        advance();
        parts.push_back(optional_expr());
      }
    }
    if (is_op(",")) unsupported(cur(), "a subscript with several indices");
    expect_op("]");
    if (!is_slice && !parts[0]) error(at, "expected an index inside '[]'");
    auto e = make_expr(is_slice ? Expr::Kind::kSlice : Expr::Kind::kGetItem, at);
    e->children.push_back(std::move(target));
    for (auto& p : parts) e->children.push_back(std::move(p));
    while (is_slice && e->children.size() < 4) e->children.push_back(nullptr);
    return e;
  }

  void parse_call_args(Expr& e) {
    expect_op("(");
    while (!is_op(")")) {
      if (!e.args.empty() || !e.kwargs.empty()) {
        expect_op(",");
        if (is_op(")")) break;
      }
      if (is_op("*") || is_op("**")) unsupported(cur(), "'*args' / '**kwargs' in a call");
      if (cur().type == TokenType::kName && peek(1).type == TokenType::kOperator &&
          peek(1).text == "=") {
        std::string key = cur().text;
        advance();
        advance();
        e.kwargs.emplace_back(std::move(key), parse_expression(true));
      } else {
        if (!e.kwargs.empty()) error(cur(), "positional argument follows keyword argument");
        e.args.push_back(parse_expression(true));
      }
    }
    advance();
  }

  ExprPtr parse_call(ExprPtr callee) {
    auto e = make_expr(Expr::Kind::kCall, cur());
    e->children.push_back(std::move(callee));
    parse_call_args(*e);
    return e;
  }

  std::string parse_dotted_name() {
    std::string name = expect_name();
    while (is_op(".")) {
      advance();
      name.push_back('.');
      name += expect_name();
    }
    return name;
  }

  // `| f(args) | g ...` applied to `input` (null: a filter block's body).
  ExprPtr parse_filter_chain(ExprPtr input, bool leading_pipe = true) {
    bool first = true;
    while (is_op("|") || (first && !leading_pipe)) {
      if (is_op("|")) advance();
      first = false;
      const Token& at = cur();
      auto f = make_expr(Expr::Kind::kFilter, at);
      f->name = parse_dotted_name();
      if (!is_known_filter(f->name)) {
        unsupported(at, fmt::format("the filter '{}'", f->name));
      }
      f->children.push_back(std::move(input));
      if (is_op("(")) parse_call_args(*f);
      input = std::move(f);
    }
    return input;
  }

  ExprPtr parse_filter_expr(ExprPtr e) {
    while (true) {
      if (is_op("|")) {
        e = parse_filter_chain(std::move(e));
      } else if (is_name("is")) {
        e = parse_test(std::move(e));
      } else if (is_op("(")) {
        e = parse_call(std::move(e));
      } else {
        return e;
      }
    }
  }

  ExprPtr parse_test(ExprPtr subject) {
    auto e = make_expr(Expr::Kind::kTest, cur());
    advance();
    if (is_name("not")) {
      e->flag = true;
      advance();
    }
    const Token& at = cur();
    e->name = parse_dotted_name();
    if (!is_known_test(e->name)) unsupported(at, fmt::format("the test '{}'", e->name));
    e->children.push_back(std::move(subject));
    const Token& next = cur();
    if (is_op("(")) {
      parse_call_args(*e);
    } else if ((next.type == TokenType::kName || next.type == TokenType::kString ||
                next.type == TokenType::kInt || next.type == TokenType::kFloat || is_op("[") ||
                is_op("{")) &&
               !is_name("else") && !is_name("or") && !is_name("and")) {
      if (is_name("is")) error(next, "tests cannot be chained with 'is'");
      e->args.push_back(parse_postfix(parse_primary()));
    }
    return e;
  }
};

}  // namespace

Body parse_tokens(const std::vector<Token>& tokens) {
  return Parser(tokens).parse_template();
}

}  // namespace recur::jinja
