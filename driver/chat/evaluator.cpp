#include "driver/chat/evaluator.h"

#include <ctime>

#include "driver/chat/lexer.h"
#include "driver/chat/operators.h"

namespace tessera::chat::jinja {
namespace {

class Evaluator {
 public:
  Evaluator(const Template& tmpl, const RenderLimits& limits) : tmpl_(tmpl), limits_(limits) {
    install_globals();
  }

  ~Evaluator() {
    // Namespaces may hold themselves (ns.x = ns); empty them so that their memory goes.
    for (auto& ns : namespaces_) ns->attrs.clear();
  }

  std::string run(const std::vector<std::pair<std::string, Value>>& context) {
    frames_.push_back(Frame{context, -1});
    current_ = 0;
    std::string out;
    exec_body(tmpl_.body, out);
    return out;
  }

 private:
  enum class Flow { kNormal, kBreak, kContinue };
  struct Frame {
    std::vector<std::pair<std::string, Value>> vars;
    int parent;
  };

  // Enters a new variable scope whose lookups fall back to frame `parent`.
  class ScopeGuard {
   public:
    ScopeGuard(Evaluator& e, int parent) : e_(e), saved_(e.current_) {
      e_.frames_.push_back(Frame{{}, parent});
      e_.current_ = static_cast<int>(e_.frames_.size()) - 1;
    }
    ~ScopeGuard() {
      e_.frames_.pop_back();
      e_.current_ = saved_;
    }

   private:
    Evaluator& e_;
    int saved_;
  };

  // ---- variables -------------------------------------------------------------------------

  Value lookup(const std::string& name) const {
    for (int f = current_; f >= 0; f = frames_[f].parent) {
      for (const auto& [n, v] : frames_[f].vars) {
        if (n == name) return v;
      }
    }
    for (const auto& [n, v] : globals_) {
      if (n == name) return v;
    }
    return Value::undefined("'" + name + "' is undefined");
  }

  void assign(const std::string& name, Value value) {
    auto& vars = frames_[current_].vars;
    for (auto& [n, v] : vars) {
      if (n == name) {
        v = std::move(value);
        return;
      }
    }
    vars.emplace_back(name, std::move(value));
  }

  void assign_target(const Target& target, const Value& value) {
    if (!target.attr.empty()) {
      Value ns = lookup(target.names[0]);
      if (!ns.is_object() || !ns.as_object()->is_namespace) {
        throw RenderError("cannot assign attribute on non-namespace object");
      }
      ns.as_object()->set(target.attr, value);
      return;
    }
    if (!target.unpack) {
      assign(target.names[0], value);
      return;
    }
    std::vector<Value> items = unpack(value, target.names.size());
    for (size_t i = 0; i < items.size(); ++i) assign(target.names[i], items[i]);
  }

  static std::vector<Value> unpack(const Value& value, size_t n) {
    std::vector<Value> items = iterate(value);
    if (items.size() < n) {
      throw RenderError("not enough values to unpack (expected " + std::to_string(n) + ", got " +
                        std::to_string(items.size()) + ")");
    }
    if (items.size() > n) {
      throw RenderError("too many values to unpack (expected " + std::to_string(n) + ")");
    }
    return items;
  }

  // ---- budget ----------------------------------------------------------------------------

  void step() {
    if (++steps_ > limits_.max_steps) {
      throw RenderError("template evaluation exceeded " + std::to_string(limits_.max_steps) +
                        " steps");
    }
  }

  const Value& charge(const Value& v) {
    if (v.is_string()) {
      work_ += v.as_string().size();
      if (work_ > limits_.max_string_work) throw RenderError("template built too much text");
    }
    return v;
  }

  void append(std::string& out, std::string_view text) {
    out += text;
    if (out.size() > limits_.max_output_bytes) {
      throw RenderError("rendered text exceeds " + std::to_string(limits_.max_output_bytes) +
                        " bytes");
    }
  }

  // ---- statements ------------------------------------------------------------------------

  Flow exec_body(const Body& body, std::string& out) {
    for (const StmtPtr& stmt : body) {
      Flow flow = exec(*stmt, out);
      if (flow != Flow::kNormal) return flow;
    }
    return Flow::kNormal;
  }

  Flow exec(const Stmt& stmt, std::string& out) {
    step();
    switch (stmt.kind) {
      case Stmt::Kind::kText:
        append(out, static_cast<const TextStmt&>(stmt).text);
        break;
      case Stmt::Kind::kOutput: {
        Value v = eval(*static_cast<const OutputStmt&>(stmt).expr);
        append(out, to_str(v));
        break;
      }
      case Stmt::Kind::kIf: {
        const auto& node = static_cast<const IfStmt&>(stmt);
        for (const auto& [cond, body] : node.branches) {
          if (truthy(eval(*cond))) return exec_body(body, out);
        }
        return exec_body(node.otherwise, out);
      }
      case Stmt::Kind::kFor:
        exec_for(static_cast<const ForStmt&>(stmt), out);
        break;
      case Stmt::Kind::kSet: {
        const auto& node = static_cast<const SetStmt&>(stmt);
        assign_target(node.target, eval(*node.value));
        break;
      }
      case Stmt::Kind::kSetBlock: {
        const auto& node = static_cast<const SetBlockStmt&>(stmt);
        Value v = apply_filters(node.filters, Value::string(render_inner(node.body)));
        assign_target(node.target, v);
        break;
      }
      case Stmt::Kind::kMacro: {
        const auto& node = static_cast<const MacroStmt&>(stmt);
        assign(node.name, Value::function(node.name, "macro", [this, &node](CallArgs& args) {
                 return call_macro(node, args);
               }));
        break;
      }
      case Stmt::Kind::kBreak:
        return Flow::kBreak;
      case Stmt::Kind::kContinue:
        return Flow::kContinue;
      case Stmt::Kind::kFilterBlock: {
        const auto& node = static_cast<const FilterBlockStmt&>(stmt);
        append(out, to_str(apply_filters(node.filters, Value::string(render_inner(node.body)))));
        break;
      }
      case Stmt::Kind::kWith: {
        const auto& node = static_cast<const WithStmt&>(stmt);
        std::vector<Value> values;
        for (const auto& [name, expr] : node.assignments) values.push_back(eval(*expr));
        ScopeGuard scope(*this, current_);
        for (size_t i = 0; i < values.size(); ++i) assign(node.assignments[i].first, values[i]);
        return exec_body(node.body, out);
      }
      case Stmt::Kind::kBlock:
        return exec_body(static_cast<const BlockStmt&>(stmt).body, out);
    }
    return Flow::kNormal;
  }

  // A body rendered into its own buffer, in its own scope ({% set %} blocks, {% filter %}).
  std::string render_inner(const Body& body) {
    ScopeGuard scope(*this, current_);
    std::string text;
    exec_body(body, text);
    return text;
  }

  void count_iteration() {
    if (++iterations_ > limits_.max_loop_iterations) {
      throw RenderError("template loops ran more than " +
                        std::to_string(limits_.max_loop_iterations) + " iterations");
    }
  }

  void bind_loop_targets(const ForStmt& node, const Value& item) {
    if (!node.unpack) {
      assign(node.targets[0], item);
      return;
    }
    std::vector<Value> parts = unpack(item, node.targets.size());
    for (size_t i = 0; i < parts.size(); ++i) assign(node.targets[i], parts[i]);
  }

  void exec_for(const ForStmt& node, std::string& out) {
    std::vector<Value> items = iterate(eval(*node.iterable));
    if (node.filter) {
      std::vector<Value> kept;
      for (Value& item : items) {
        count_iteration();
        ScopeGuard scope(*this, current_);
        bind_loop_targets(node, item);
        if (truthy(eval(*node.filter))) kept.push_back(std::move(item));
      }
      items = std::move(kept);
    }
    if (items.empty()) {
      exec_body(node.otherwise, out);
      return;
    }
    const auto n = static_cast<int64_t>(items.size());
    for (int64_t i = 0; i < n; ++i) {
      count_iteration();
      ScopeGuard scope(*this, current_);
      bind_loop_targets(node, items[i]);
      assign("loop", make_loop(items, i));
      if (exec_body(node.body, out) == Flow::kBreak) break;
    }
  }

  static Value make_loop(const std::vector<Value>& items, int64_t i) {
    const auto n = static_cast<int64_t>(items.size());
    auto loop = std::make_shared<ObjectData>();
    loop->type_name = "LoopContext";
    auto put = [&](const char* name, Value v) { loop->set(name, std::move(v)); };
    put("index0", Value::integer(i));
    put("index", Value::integer(i + 1));
    put("revindex0", Value::integer(n - i - 1));
    put("revindex", Value::integer(n - i));
    put("first", Value::boolean(i == 0));
    put("last", Value::boolean(i == n - 1));
    put("length", Value::integer(n));
    put("depth", Value::integer(1));
    put("depth0", Value::integer(0));
    put("previtem", i > 0 ? items[i - 1] : Value::undefined("there is no previous item"));
    put("nextitem", i + 1 < n ? items[i + 1] : Value::undefined("there is no next item"));
    put("cycle", Value::function("cycle", "method", [i](CallArgs& args) {
          if (args.positional.empty()) throw RenderError("no items for cycling given");
          return args.positional[i % args.positional.size()];
        }));
    return Value::object(std::move(loop));
  }

  Value call_macro(const MacroStmt& node, CallArgs& args) {
    if (call_depth_ >= limits_.max_call_depth) {
      throw RenderError("macro calls nest deeper than " + std::to_string(limits_.max_call_depth));
    }
    if (args.positional.size() > node.params.size()) {
      throw RenderError("macro '" + node.name + "' takes not more than " +
                        std::to_string(node.params.size()) + " argument(s)");
    }
    for (const auto& [key, value] : args.keyword) {
      bool known = false;
      for (const auto& param : node.params) known = known || param.first == key;
      if (!known) {
        throw RenderError("macro '" + node.name + "' takes no keyword argument '" + key + "'");
      }
    }
    ++call_depth_;
    struct DepthRestore {
      int& depth;
      ~DepthRestore() { --depth; }
    } restore{call_depth_};
    ScopeGuard scope(*this, 0);  // macros see the template's top level, not the caller
    for (size_t i = 0; i < node.params.size(); ++i) {
      const auto& [name, fallback] = node.params[i];
      std::optional<Value> value;
      if (i < args.positional.size()) value = args.positional[i];
      for (const auto& [key, v] : args.keyword) {
        if (key == name) value = v;
      }
      if (!value) {
        value = fallback ? eval(*fallback)
                         : Value::undefined("parameter '" + name + "' was not provided");
      }
      assign(name, *value);
    }
    std::string text;
    exec_body(node.body, text);
    return Value::string(std::move(text));
  }

  // ---- expressions -----------------------------------------------------------------------

  CallArgs eval_args(const ArgExprs& exprs) {
    CallArgs args;
    for (const ExprPtr& e : exprs.positional) args.positional.push_back(eval(*e));
    for (const auto& [key, e] : exprs.keyword) args.keyword.emplace_back(key, eval(*e));
    return args;
  }

  Value apply_filter(const FilterExpr& filter, const Value& input) {
    if (filter.fn == nullptr) {
      throw RenderError("filter '" + filter.name +
                        "' is not supported by this chat template renderer");
    }
    CallArgs args = eval_args(filter.args);
    return charge(filter.fn(input, args));
  }

  Value apply_filters(const std::vector<std::unique_ptr<FilterExpr>>& filters, Value v) {
    for (const auto& f : filters) v = apply_filter(*f, v);
    return v;
  }

  bool compare_op(Op op, const Value& a, const Value& b) {
    switch (op) {
      case Op::kEq:
        return equals(a, b);
      case Op::kNe:
        return !equals(a, b);
      case Op::kLt:
        return compare(a, b, "<") < 0;
      case Op::kLe:
        return compare(a, b, "<=") <= 0;
      case Op::kGt:
        return compare(a, b, ">") > 0;
      case Op::kGe:
        return compare(a, b, ">=") >= 0;
      case Op::kIn:
        return contains(b, a);
      case Op::kNotIn:
        return !contains(b, a);
      default:
        throw RenderError("internal error: not a comparison");
    }
  }

  Value eval(const Expr& expr) {
    step();
    switch (expr.kind) {
      case Expr::Kind::kLiteral:
        return static_cast<const LiteralExpr&>(expr).value;
      case Expr::Kind::kName:
        return lookup(static_cast<const NameExpr&>(expr).name);
      case Expr::Kind::kList: {
        const auto& node = static_cast<const ListExpr&>(expr);
        std::vector<Value> items;
        items.reserve(node.items.size());
        for (const ExprPtr& e : node.items) items.push_back(eval(*e));
        return Value::list(std::move(items), node.tuple);
      }
      case Expr::Kind::kDict: {
        std::vector<std::pair<std::string, Value>> items;
        for (const auto& [k, v] : static_cast<const DictExpr&>(expr).items) {
          Value key = eval(*k);
          if (!key.is_string()) throw RenderError("dict keys must be strings in chat templates");
          items.emplace_back(key.as_string(), eval(*v));
        }
        return Value::dict(std::move(items));
      }
      case Expr::Kind::kAttr: {
        const auto& node = static_cast<const AttrExpr&>(expr);
        return get_attr(eval(*node.object), node.name);
      }
      case Expr::Kind::kItem: {
        const auto& node = static_cast<const ItemExpr&>(expr);
        Value object = eval(*node.object);
        return get_item(object, eval(*node.index));
      }
      case Expr::Kind::kSlice: {
        const auto& node = static_cast<const SliceExpr&>(expr);
        Value object = eval(*node.object);
        auto opt = [&](const ExprPtr& e) -> std::optional<Value> {
          if (!e) return std::nullopt;
          return eval(*e);
        };
        auto start = opt(node.start);
        auto stop = opt(node.stop);
        return get_slice(object, start, stop, opt(node.step));
      }
      case Expr::Kind::kCall: {
        const auto& node = static_cast<const CallExpr&>(expr);
        Value callee = eval(*node.callee);
        if (callee.is_undefined()) callee.fail_undefined();
        if (!callee.is_function()) {
          throw RenderError("'" + type_name(callee) + "' object is not callable");
        }
        CallArgs args = eval_args(node.args);
        return charge(callee.as_function().call(args));
      }
      case Expr::Kind::kFilter: {
        const auto& node = static_cast<const FilterExpr&>(expr);
        return apply_filter(node, eval(*node.input));
      }
      case Expr::Kind::kTest: {
        const auto& node = static_cast<const TestExpr&>(expr);
        if (node.fn == nullptr) {
          throw RenderError("test '" + node.name +
                            "' is not supported by this chat template renderer");
        }
        Value input = eval(*node.input);
        CallArgs args = eval_args(node.args);
        return Value::boolean(node.fn(input, args) != node.negated);
      }
      case Expr::Kind::kUnary: {
        const auto& node = static_cast<const UnaryExpr&>(expr);
        Value v = eval(*node.operand);
        if (node.op == Op::kNot) return Value::boolean(!truthy(v));
        return unary_op(node.op, v);
      }
      case Expr::Kind::kBinary: {
        const auto& node = static_cast<const BinaryExpr&>(expr);
        Value left = eval(*node.left);
        if (node.op == Op::kAnd) return truthy(left) ? eval(*node.right) : left;
        if (node.op == Op::kOr) return truthy(left) ? left : eval(*node.right);
        return charge(binary_op(node.op, left, eval(*node.right)));
      }
      case Expr::Kind::kCompare: {
        const auto& node = static_cast<const CompareExpr&>(expr);
        Value left = eval(*node.first);
        for (const auto& [op, e] : node.rest) {
          Value right = eval(*e);
          if (!compare_op(op, left, right)) return Value::boolean(false);
          left = std::move(right);
        }
        return Value::boolean(true);
      }
      case Expr::Kind::kCond: {
        const auto& node = static_cast<const CondExpr&>(expr);
        if (truthy(eval(*node.cond))) return eval(*node.then);
        if (node.otherwise) return eval(*node.otherwise);
        int line = line_column(tmpl_.source, expr.offset).first;
        return Value::undefined("the inline if-expression on line " + std::to_string(line) +
                                " evaluated to false and no else section was defined.");
      }
    }
    throw RenderError("internal error: unknown expression");
  }

  // ---- globals ---------------------------------------------------------------------------

  void install_globals() {
    auto add = [&](const char* name, std::function<Value(CallArgs&)> fn) {
      globals_.emplace_back(name, Value::function(name, "builtin", std::move(fn)));
    };
    add("range", [](CallArgs& args) {
      auto b = args.bind("range", {"start", "stop", "step"}, 1);
      for (const auto& v : b) {
        if (v && !v->is_int() && !v->is_bool()) {
          throw RenderError("'" + type_name(*v) + "' object cannot be interpreted as an integer");
        }
      }
      int64_t start = b[1] ? b[0]->as_int() : 0;
      int64_t stop = b[1] ? b[1]->as_int() : b[0]->as_int();
      int64_t step = b[2] ? b[2]->as_int() : 1;
      if (step == 0) throw RenderError("range() arg 3 must not be zero");
      std::vector<Value> out;
      for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
        if (out.size() >= kMaxListItems) throw RenderError("range too large");
        out.push_back(Value::integer(i));
        if ((step > 0 && i > INT64_MAX - step) || (step < 0 && i < INT64_MIN - step)) break;
      }
      return Value::list(std::move(out));
    });
    add("namespace", [this](CallArgs& args) {
      auto ns = std::make_shared<ObjectData>();
      ns->type_name = "Namespace";
      ns->is_namespace = true;
      for (const Value& v : args.positional) {
        if (!v.is_dict()) throw RenderError("namespace() takes a mapping or keyword arguments");
        for (const auto& [k, item] : v.as_dict().items) ns->set(k, item);
      }
      for (const auto& [k, v] : args.keyword) ns->set(k, v);
      namespaces_.push_back(ns);
      return Value::object(std::move(ns));
    });
    add("dict", [](CallArgs& args) {
      std::vector<std::pair<std::string, Value>> items;
      for (const Value& v : args.positional) {
        if (!v.is_dict()) throw RenderError("dict() takes a mapping or keyword arguments");
        items.insert(items.end(), v.as_dict().items.begin(), v.as_dict().items.end());
      }
      items.insert(items.end(), args.keyword.begin(), args.keyword.end());
      return Value::dict(std::move(items));
    });
    add("raise_exception", [](CallArgs& args) -> Value {
      auto b = args.bind("raise_exception", {"message"}, 1);
      std::string message = to_str(*b[0]);
      // An empty message (raise_exception(''), or of an undefined name) still has to say what
      // happened.
      if (message.empty()) message = "the chat template raised an exception with no message";
      throw RenderError(std::move(message));
    });
    add("strftime_now", [](CallArgs& args) {
      auto b = args.bind("strftime_now", {"format"}, 1);
      std::time_t now = std::time(nullptr);
      std::tm local{};
      localtime_r(&now, &local);
      std::string format = to_str(*b[0]);
      if (format.empty()) return Value::string("");
      std::string out(256 + format.size() * 16, '\0');
      size_t n = std::strftime(out.data(), out.size(), format.c_str(), &local);
      out.resize(n);
      return Value::string(std::move(out));
    });
  }

  const Template& tmpl_;
  const RenderLimits& limits_;
  std::vector<Frame> frames_;
  int current_ = 0;
  std::vector<std::pair<std::string, Value>> globals_;
  std::vector<std::shared_ptr<ObjectData>> namespaces_;
  int call_depth_ = 0;
  int64_t steps_ = 0;
  int64_t iterations_ = 0;
  uint64_t work_ = 0;
};

}  // namespace

std::string render_template(const Template& tmpl,
                            const std::vector<std::pair<std::string, Value>>& context,
                            const RenderLimits& limits) {
  Evaluator evaluator(tmpl, limits);
  return evaluator.run(context);
}

}  // namespace tessera::chat::jinja
