#include "driver/chat/parser.h"

#include <initializer_list>

#include "driver/chat/lexer.h"

namespace tessera::chat::jinja {
namespace {

template <typename T>
std::unique_ptr<T> make(size_t offset) {
  auto node = std::make_unique<T>();
  node->offset = offset;
  return node;
}

std::string describe(const Token& t) {
  switch (t.type) {
    case TokenType::kData:
      return "template data";
    case TokenType::kVariableBegin:
      return "begin of print statement";
    case TokenType::kVariableEnd:
      return "end of print statement";
    case TokenType::kBlockBegin:
      return "begin of statement block";
    case TokenType::kBlockEnd:
      return "end of statement block";
    case TokenType::kString:
      return "string";
    case TokenType::kEnd:
      return "end of template";
    default:
      return t.value;
  }
}

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : tokens_(std::move(tokens)) {}

  Body parse_template() {
    Body body = subparse({});
    if (cur().type != TokenType::kEnd) fail("unexpected '" + describe(cur()) + "'");
    return body;
  }

 private:
  // Counts nesting on the C++ stack; too deep is a syntax error, never a crash.
  class DepthGuard {
   public:
    explicit DepthGuard(Parser& p) : p_(p) {
      if (++p_.depth_ > kMaxSyntaxDepth) p_.fail("template nests too deeply");
    }
    ~DepthGuard() { --p_.depth_; }

   private:
    Parser& p_;
  };

  const Token& cur() const { return tokens_[pos_]; }
  const Token& peek() const { return tokens_[pos_ + 1 < tokens_.size() ? pos_ + 1 : pos_]; }
  void advance() {
    if (pos_ + 1 < tokens_.size()) ++pos_;
  }
  [[noreturn]] void fail(const std::string& message) const {
    throw SyntaxError{cur().offset, message};
  }

  bool is_op(std::string_view op) const {
    return cur().type == TokenType::kOperator && cur().value == op;
  }
  bool is_name(std::string_view name) const {
    return cur().type == TokenType::kName && cur().value == name;
  }
  bool skip_op(std::string_view op) {
    if (!is_op(op)) return false;
    advance();
    return true;
  }
  bool skip_name(std::string_view name) {
    if (!is_name(name)) return false;
    advance();
    return true;
  }
  void expect_op(std::string_view op) {
    if (!skip_op(op))
      fail("expected token '" + std::string(op) + "', got '" + describe(cur()) + "'");
  }
  void expect(TokenType type, const char* what) {
    if (cur().type != type)
      fail(std::string("expected token '") + what + "', got '" + describe(cur()) + "'");
    advance();
  }
  std::string expect_name() {
    if (cur().type != TokenType::kName)
      fail("expected token 'name', got '" + describe(cur()) + "'");
    std::string name = cur().value;
    advance();
    return name;
  }
  void expect_block_end() { expect(TokenType::kBlockEnd, "end of statement block"); }

  // ---- statements ------------------------------------------------------------------------

  // Parses until "{% <one of end_tags>": returns with the tag name as the current token.
  Body subparse(std::initializer_list<std::string_view> end_tags) {
    DepthGuard guard(*this);
    Body body;
    while (true) {
      const Token& t = cur();
      if (t.type == TokenType::kData) {
        auto text = make<TextStmt>(t.offset);
        text->text = t.value;
        body.push_back(std::move(text));
        advance();
      } else if (t.type == TokenType::kVariableBegin) {
        advance();
        auto out = make<OutputStmt>(t.offset);
        out->expr = parse_tuple(true, false);
        expect(TokenType::kVariableEnd, "end of print statement");
        body.push_back(std::move(out));
      } else if (t.type == TokenType::kBlockBegin) {
        advance();
        if (cur().type == TokenType::kName) {
          for (std::string_view end : end_tags) {
            if (cur().value == end) return body;
          }
        }
        body.push_back(parse_statement(end_tags));
      } else if (t.type == TokenType::kEnd) {
        if (end_tags.size() != 0) {
          std::string looking;
          for (std::string_view end : end_tags) {
            looking += (looking.empty() ? "'" : " or '") + std::string(end) + "'";
          }
          fail("Unexpected end of template. Jinja was looking for the following tags: " + looking +
               ". The innermost block that needs to be closed is '" + open_blocks_.back() + "'.");
        }
        return body;
      } else {
        fail("unexpected '" + describe(t) + "'");
      }
    }
  }

  // After the opening tag's block end: the body up to one of `end_tags` (left current).
  Body parse_body(const char* block, std::initializer_list<std::string_view> end_tags) {
    expect_block_end();
    open_blocks_.push_back(block);
    Body body = subparse(end_tags);
    open_blocks_.pop_back();
    return body;
  }

  StmtPtr parse_statement(std::initializer_list<std::string_view> enclosing_ends) {
    const Token& t = cur();
    if (t.type != TokenType::kName) fail("tag name expected");
    size_t offset = t.offset;
    std::string tag = t.value;
    advance();
    if (tag == "if") return parse_if(offset);
    if (tag == "for") return parse_for(offset);
    if (tag == "set") return parse_set(offset);
    if (tag == "macro") return parse_macro(offset);
    if (tag == "filter") return parse_filter_block(offset);
    if (tag == "with") return parse_with(offset);
    if (tag == "generation") {
      auto block = make<BlockStmt>(offset);
      block->body = parse_body("generation", {"endgeneration"});
      advance();
      expect_block_end();
      return block;
    }
    if (tag == "break" || tag == "continue") {
      if (loop_depth_ == 0) fail("'" + tag + "' outside of a for loop");
      expect_block_end();
      if (tag == "break") return make<BreakStmt>(offset);
      return make<ContinueStmt>(offset);
    }
    pos_--;  // report at the tag name
    std::string message = "Encountered unknown tag '" + tag + "'.";
    if (enclosing_ends.size() != 0) {
      message += " Jinja was looking for the following tags: ";
      bool first = true;
      for (std::string_view end : enclosing_ends) {
        message += (first ? "'" : " or '") + std::string(end) + "'";
        first = false;
      }
      message += ". The innermost block that needs to be closed is '" + open_blocks_.back() + "'.";
    }
    fail(message);
  }

  StmtPtr parse_if(size_t offset) {
    auto node = make<IfStmt>(offset);
    while (true) {
      ExprPtr cond = parse_tuple(false, false);
      Body body = parse_body("if", {"elif", "else", "endif"});
      node->branches.emplace_back(std::move(cond), std::move(body));
      std::string tag = cur().value;
      advance();
      if (tag == "elif") continue;
      if (tag == "else") {
        node->otherwise = parse_body("if", {"endif"});
        advance();
      }
      break;
    }
    expect_block_end();
    return node;
  }

  Target parse_target(bool allow_attr) {
    Target target;
    bool parens = skip_op("(");
    target.names.push_back(expect_name());
    if (allow_attr && !parens && is_op(".")) {
      advance();
      target.attr = expect_name();
      return target;
    }
    while (skip_op(",")) {
      target.unpack = true;
      if (cur().type != TokenType::kName || is_name("in")) break;
      target.names.push_back(expect_name());
    }
    if (parens) {
      expect_op(")");
      target.unpack = true;
    }
    return target;
  }

  StmtPtr parse_for(size_t offset) {
    auto node = make<ForStmt>(offset);
    Target target = parse_target(false);
    node->targets = std::move(target.names);
    node->unpack = target.unpack;
    if (!skip_name("in")) fail("expected token 'in', got '" + describe(cur()) + "'");
    node->iterable = parse_tuple(false, false);
    if (skip_name("if")) node->filter = parse_expression(true);
    if (is_name("recursive")) fail("recursive for loops are not supported");
    ++loop_depth_;
    node->body = parse_body("for", {"endfor", "else"});
    --loop_depth_;
    if (cur().value == "else") {
      advance();
      node->otherwise = parse_body("for", {"endfor"});
    }
    advance();
    expect_block_end();
    return node;
  }

  std::vector<std::unique_ptr<FilterExpr>> parse_filter_chain(bool first_inline) {
    std::vector<std::unique_ptr<FilterExpr>> chain;
    while (first_inline || is_op("|")) {
      if (!first_inline) advance();
      first_inline = false;
      chain.push_back(parse_filter_spec());
    }
    return chain;
  }

  StmtPtr parse_set(size_t offset) {
    Target target = parse_target(true);
    if (skip_op("=")) {
      auto node = make<SetStmt>(offset);
      node->target = std::move(target);
      node->value = parse_tuple(true, false);
      expect_block_end();
      return node;
    }
    auto node = make<SetBlockStmt>(offset);
    node->target = std::move(target);
    node->filters = parse_filter_chain(false);
    node->body = parse_body("set", {"endset"});
    advance();
    expect_block_end();
    return node;
  }

  StmtPtr parse_macro(size_t offset) {
    auto node = make<MacroStmt>(offset);
    node->name = expect_name();
    expect_op("(");
    while (!is_op(")")) {
      if (!node->params.empty()) expect_op(",");
      if (is_op(")")) break;
      std::string param = expect_name();
      ExprPtr fallback;
      if (skip_op("=")) {
        fallback = parse_expression(true);
      } else if (!node->params.empty() && node->params.back().second) {
        fail("non-default argument follows default argument");
      }
      node->params.emplace_back(std::move(param), std::move(fallback));
    }
    advance();
    int saved_loops = loop_depth_;
    loop_depth_ = 0;  // a loop around the definition is not the macro's loop
    node->body = parse_body("macro", {"endmacro"});
    loop_depth_ = saved_loops;
    advance();
    expect_block_end();
    return node;
  }

  StmtPtr parse_filter_block(size_t offset) {
    auto node = make<FilterBlockStmt>(offset);
    node->filters = parse_filter_chain(true);
    node->body = parse_body("filter", {"endfilter"});
    advance();
    expect_block_end();
    return node;
  }

  StmtPtr parse_with(size_t offset) {
    auto node = make<WithStmt>(offset);
    while (cur().type != TokenType::kBlockEnd) {
      if (!node->assignments.empty()) expect_op(",");
      std::string name = expect_name();
      expect_op("=");
      node->assignments.emplace_back(std::move(name), parse_expression(true));
    }
    node->body = parse_body("with", {"endwith"});
    advance();
    expect_block_end();
    return node;
  }

  // ---- expressions -----------------------------------------------------------------------

  bool is_tuple_end() const {
    return cur().type == TokenType::kVariableEnd || cur().type == TokenType::kBlockEnd ||
           is_op(")") || cur().type == TokenType::kEnd;
  }

  // `a, b, c` (a tuple) or a single expression; with_condexpr false: no `x if y else z`.
  ExprPtr parse_tuple(bool with_condexpr, bool explicit_parens) {
    size_t offset = cur().offset;
    std::vector<ExprPtr> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) expect_op(",");
      if (is_tuple_end()) break;
      items.push_back(parse_expression(with_condexpr));
      if (is_op(",")) {
        is_tuple = true;
      } else {
        break;
      }
    }
    if (!is_tuple) {
      if (!items.empty()) return std::move(items[0]);
      if (!explicit_parens) fail("Expected an expression, got '" + describe(cur()) + "'");
    }
    auto node = make<ListExpr>(offset);
    node->items = std::move(items);
    node->tuple = true;
    return node;
  }

  ExprPtr parse_expression(bool with_condexpr) {
    DepthGuard guard(*this);
    if (!with_condexpr) return parse_or();
    ExprPtr expr = parse_or();
    while (is_name("if")) {
      auto node = make<CondExpr>(cur().offset);
      advance();
      node->cond = parse_or();
      if (skip_name("else")) node->otherwise = parse_expression(true);
      node->then = std::move(expr);
      expr = std::move(node);
    }
    return expr;
  }

  ExprPtr binary(Op op, ExprPtr left, ExprPtr right, size_t offset) {
    auto node = make<BinaryExpr>(offset);
    node->op = op;
    node->left = std::move(left);
    node->right = std::move(right);
    return node;
  }

  ExprPtr parse_or() {
    ExprPtr left = parse_and();
    while (is_name("or")) {
      size_t offset = cur().offset;
      advance();
      left = binary(Op::kOr, std::move(left), parse_and(), offset);
    }
    return left;
  }

  ExprPtr parse_and() {
    ExprPtr left = parse_not();
    while (is_name("and")) {
      size_t offset = cur().offset;
      advance();
      left = binary(Op::kAnd, std::move(left), parse_not(), offset);
    }
    return left;
  }

  ExprPtr parse_not() {
    if (is_name("not")) {
      DepthGuard guard(*this);
      auto node = make<UnaryExpr>(cur().offset);
      advance();
      node->op = Op::kNot;
      node->operand = parse_not();
      return node;
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    size_t offset = cur().offset;
    ExprPtr first = parse_math1();
    std::vector<std::pair<Op, ExprPtr>> rest;
    while (true) {
      Op op;
      if (is_op("==")) {
        op = Op::kEq;
      } else if (is_op("!=")) {
        op = Op::kNe;
      } else if (is_op("<")) {
        op = Op::kLt;
      } else if (is_op("<=")) {
        op = Op::kLe;
      } else if (is_op(">")) {
        op = Op::kGt;
      } else if (is_op(">=")) {
        op = Op::kGe;
      } else if (is_name("in")) {
        op = Op::kIn;
      } else if (is_name("not") && peek().type == TokenType::kName && peek().value == "in") {
        advance();
        op = Op::kNotIn;
      } else {
        break;
      }
      advance();
      rest.emplace_back(op, parse_math1());
    }
    if (rest.empty()) return first;
    auto node = make<CompareExpr>(offset);
    node->first = std::move(first);
    node->rest = std::move(rest);
    return node;
  }

  ExprPtr parse_math1() {
    ExprPtr left = parse_concat();
    while (is_op("+") || is_op("-")) {
      Op op = is_op("+") ? Op::kAdd : Op::kSub;
      size_t offset = cur().offset;
      advance();
      left = binary(op, std::move(left), parse_concat(), offset);
    }
    return left;
  }

  ExprPtr parse_concat() {
    ExprPtr left = parse_math2();
    while (is_op("~")) {
      size_t offset = cur().offset;
      advance();
      left = binary(Op::kConcat, std::move(left), parse_math2(), offset);
    }
    return left;
  }

  ExprPtr parse_math2() {
    ExprPtr left = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      Op op = is_op("*")    ? Op::kMul
              : is_op("/")  ? Op::kDiv
              : is_op("//") ? Op::kFloorDiv
                            : Op::kMod;
      size_t offset = cur().offset;
      advance();
      left = binary(op, std::move(left), parse_pow(), offset);
    }
    return left;
  }

  ExprPtr parse_pow() {
    ExprPtr left = parse_unary(true);
    while (is_op("**")) {
      size_t offset = cur().offset;
      advance();
      left = binary(Op::kPow, std::move(left), parse_unary(true), offset);
    }
    return left;
  }

  ExprPtr parse_unary(bool with_filter) {
    DepthGuard guard(*this);
    ExprPtr node;
    if (is_op("-") || is_op("+")) {
      auto unary = make<UnaryExpr>(cur().offset);
      unary->op = is_op("-") ? Op::kNeg : Op::kPos;
      advance();
      unary->operand = parse_unary(false);
      node = std::move(unary);
    } else {
      node = parse_primary();
    }
    node = parse_postfix(std::move(node));
    if (with_filter) node = parse_filter_expr(std::move(node));
    return node;
  }

  ExprPtr parse_primary() {
    const Token& t = cur();
    size_t offset = t.offset;
    if (t.type == TokenType::kName) {
      auto literal = make<LiteralExpr>(offset);
      if (t.value == "true" || t.value == "True") {
        literal->value = Value::boolean(true);
      } else if (t.value == "false" || t.value == "False") {
        literal->value = Value::boolean(false);
      } else if (t.value == "none" || t.value == "None") {
        literal->value = Value::none();
      } else {
        auto name = make<NameExpr>(offset);
        name->name = t.value;
        advance();
        return name;
      }
      advance();
      return literal;
    }
    if (t.type == TokenType::kString) {
      std::string text;
      while (cur().type == TokenType::kString) {  // adjacent literals concatenate
        text += cur().value;
        advance();
      }
      auto literal = make<LiteralExpr>(offset);
      literal->value = Value::string(std::move(text));
      return literal;
    }
    if (t.type == TokenType::kInteger || t.type == TokenType::kFloat) {
      auto literal = make<LiteralExpr>(offset);
      literal->value = t.type == TokenType::kInteger ? Value::integer(t.int_value)
                                                     : Value::number(t.float_value);
      advance();
      return literal;
    }
    if (skip_op("(")) {
      ExprPtr inner = parse_tuple(true, true);
      expect_op(")");
      return inner;
    }
    if (skip_op("[")) {
      auto list = make<ListExpr>(offset);
      while (!is_op("]")) {
        if (!list->items.empty()) expect_op(",");
        if (is_op("]")) break;
        list->items.push_back(parse_expression(true));
      }
      advance();
      return list;
    }
    if (skip_op("{")) {
      auto dict = make<DictExpr>(offset);
      while (!is_op("}")) {
        if (!dict->items.empty()) expect_op(",");
        if (is_op("}")) break;
        ExprPtr key = parse_expression(true);
        expect_op(":");
        dict->items.emplace_back(std::move(key), parse_expression(true));
      }
      advance();
      return dict;
    }
    fail("unexpected '" + describe(t) + "'");
  }

  ExprPtr parse_postfix(ExprPtr node) {
    while (true) {
      if (is_op(".") || is_op("[")) {
        node = parse_subscript(std::move(node));
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_filter_expr(ExprPtr node) {
    while (true) {
      if (is_op("|")) {
        advance();
        auto filter = parse_filter_spec();
        filter->input = std::move(node);
        node = std::move(filter);
      } else if (is_name("is")) {
        node = parse_test(std::move(node));
      } else if (is_op("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr object) {
    size_t offset = cur().offset;
    if (skip_op(".")) {
      if (cur().type == TokenType::kName) {
        auto attr = make<AttrExpr>(offset);
        attr->object = std::move(object);
        attr->name = expect_name();
        return attr;
      }
      if (cur().type != TokenType::kInteger) fail("expected name or number");
      auto item = make<ItemExpr>(offset);
      item->object = std::move(object);
      auto index = make<LiteralExpr>(cur().offset);
      index->value = Value::integer(cur().int_value);
      item->index = std::move(index);
      advance();
      return item;
    }
    advance();  // '['
    ExprPtr start;
    if (!is_op(":")) {
      start = parse_expression(true);
      if (skip_op("]")) {
        auto item = make<ItemExpr>(offset);
        item->object = std::move(object);
        item->index = std::move(start);
        return item;
      }
      if (is_op(",")) fail("tuple subscripts are not supported");
    }
    auto slice = make<SliceExpr>(offset);
    slice->object = std::move(object);
    slice->start = std::move(start);
    expect_op(":");
    if (!is_op("]") && !is_op(":")) slice->stop = parse_expression(true);
    if (skip_op(":") && !is_op("]")) slice->step = parse_expression(true);
    expect_op("]");
    return slice;
  }

  ArgExprs parse_args() {
    expect_op("(");
    ArgExprs args;
    while (!is_op(")")) {
      if (!args.positional.empty() || !args.keyword.empty()) expect_op(",");
      if (is_op(")")) break;
      if (is_op("*") || is_op("**")) fail("*args and **kwargs are not supported");
      if (cur().type == TokenType::kName && peek().type == TokenType::kOperator &&
          peek().value == "=") {
        std::string key = expect_name();
        advance();
        args.keyword.emplace_back(std::move(key), parse_expression(true));
      } else {
        if (!args.keyword.empty()) fail("invalid syntax for function call expression");
        args.positional.push_back(parse_expression(true));
      }
    }
    advance();
    return args;
  }

  ExprPtr parse_call(ExprPtr callee) {
    auto call = make<CallExpr>(cur().offset);
    call->callee = std::move(callee);
    call->args = parse_args();
    return call;
  }

  std::string parse_dotted_name() {
    std::string name = expect_name();
    while (skip_op(".")) name += "." + expect_name();
    return name;
  }

  std::unique_ptr<FilterExpr> parse_filter_spec() {
    auto filter = make<FilterExpr>(cur().offset);
    filter->name = parse_dotted_name();
    Builtin<FilterFn> builtin = find_filter(filter->name);
    if (!builtin.known)
      throw SyntaxError{filter->offset, "No filter named '" + filter->name + "'."};
    filter->fn = builtin.fn;
    if (is_op("(")) filter->args = parse_args();
    return filter;
  }

  ExprPtr parse_test(ExprPtr input) {
    auto test = make<TestExpr>(cur().offset);
    advance();  // 'is'
    test->negated = skip_name("not");
    size_t name_offset = cur().offset;
    test->name = parse_dotted_name();
    Builtin<TestFn> builtin = find_test(test->name);
    if (!builtin.known) throw SyntaxError{name_offset, "No test named '" + test->name + "'."};
    test->fn = builtin.fn;
    test->input = std::move(input);
    const Token& t = cur();
    if (is_op("(")) {
      test->args = parse_args();
    } else if ((t.type == TokenType::kName && t.value != "else" && t.value != "or" &&
                t.value != "and") ||
               t.type == TokenType::kString || t.type == TokenType::kInteger ||
               t.type == TokenType::kFloat || is_op("[") || is_op("{")) {
      test->args.positional.push_back(parse_postfix(parse_primary()));
    }
    return test;
  }

  std::vector<Token> tokens_;
  size_t pos_ = 0;
  int depth_ = 0;
  int loop_depth_ = 0;
  std::vector<std::string> open_blocks_;
};

}  // namespace

Expected<std::shared_ptr<const Template>> parse_template(std::string_view source) {
  auto tmpl = std::make_shared<Template>();
  tmpl->source = normalize_source(source);
  try {
    tmpl->body = Parser(tokenize(tmpl->source)).parse_template();
  } catch (const SyntaxError& e) {
    auto [line, column] = line_column(tmpl->source, e.offset);
    return invalid_argument("line " + std::to_string(line) + ", column " + std::to_string(column) +
                            ": " + e.message);
  } catch (const RenderError& e) {  // a literal too large for a value
    return invalid_argument(e.what());
  }
  return std::shared_ptr<const Template>(std::move(tmpl));
}

}  // namespace tessera::chat::jinja
