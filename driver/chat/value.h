// The values a chat template computes with, with Python's semantics (Jinja runs on Python).
//
// A Value is undefined, None, a bool, an int, a float, a str, a list or tuple, a dict (string
// keys, insertion order), an object with attributes (a Jinja namespace or loop) or a callable.
// Lists and dicts are immutable once built and shared by reference, as in Jinja's
// ImmutableSandboxedEnvironment; only namespace objects change after they are made.
//
// Errors while computing (a TypeError in Python, an UndefinedError in Jinja) are thrown as
// RenderError; ChatTemplate turns them into a Status at its boundary, and nothing else in this
// directory lets them escape.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

namespace tessera::chat::jinja {

// An error raised while rendering. `what()` is the message the caller sees (for
// raise_exception, exactly the template's message).
class RenderError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Deepest nesting of lists, dicts and objects a value may have. Deeper data (from JSON or
// built by a template) is refused, so that printing, comparing and freeing never recurse
// without bound.
inline constexpr int kMaxValueDepth = 200;
// Largest string and list a template may build.
inline constexpr size_t kMaxStringBytes = size_t{32} << 20;
inline constexpr size_t kMaxListItems = 1'000'000;

class Value;
struct CallArgs;

struct ListData {
  std::vector<Value> items;
  bool tuple = false;
  int depth = 1;
};

struct DictData {
  std::vector<std::pair<std::string, Value>> items;  // insertion order, unique keys
  int depth = 1;
  // nullptr when absent. Linear: template dicts are small.
  const Value* find(std::string_view key) const;
};

// A Jinja namespace (mutable attributes) or loop context.
struct ObjectData {
  std::string type_name;  // "Namespace", "LoopContext"
  std::vector<std::pair<std::string, Value>> attrs;
  bool is_namespace = false;
  int depth = 1;
  const Value* find(std::string_view name) const;
  // Sets or adds an attribute; throws when the value would nest too deeply.
  void set(const std::string& name, Value value);
};

struct FunctionData {
  std::string name;
  std::string kind;  // "macro", "method", "builtin": how repr() shows it
  std::function<Value(CallArgs&)> call;
  int depth = 1;
};

class Value {
 public:
  enum class Kind {
    kUndefined,
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kList,
    kDict,
    kObject,
    kFunction
  };

  // Undefined; `message` is the error raised when it is used where a value is needed, e.g.
  // "'foo' is undefined" or "'dict object' has no attribute 'bar'".
  Value() : v_(Undefined{}) {}
  static Value undefined(std::string message);
  static Value none();
  static Value boolean(bool b);
  static Value integer(int64_t i);
  static Value number(double d);
  static Value string(std::string s);
  // Throws RenderError when the list is too long or too deep.
  static Value list(std::vector<Value> items, bool tuple = false);
  // Keys must be unique (later duplicates replace earlier ones, as in Python).
  static Value dict(std::vector<std::pair<std::string, Value>> items);
  static Value object(std::shared_ptr<ObjectData> object);
  static Value function(std::string name, std::string kind, std::function<Value(CallArgs&)> call,
                        int depth = 1);

  Kind kind() const { return static_cast<Kind>(v_.index()); }
  bool is_undefined() const { return kind() == Kind::kUndefined; }
  bool is_none() const { return kind() == Kind::kNone; }
  bool is_bool() const { return kind() == Kind::kBool; }
  bool is_int() const { return kind() == Kind::kInt; }
  bool is_float() const { return kind() == Kind::kFloat; }
  // int, float or bool (a bool is an int in Python).
  bool is_number() const { return is_int() || is_float() || is_bool(); }
  bool is_string() const { return kind() == Kind::kString; }
  bool is_list() const { return kind() == Kind::kList; }
  bool is_dict() const { return kind() == Kind::kDict; }
  bool is_object() const { return kind() == Kind::kObject; }
  bool is_function() const { return kind() == Kind::kFunction; }

  // Preconditions: the matching kind.
  bool as_bool() const { return std::get<bool>(v_); }
  int64_t as_int() const;   // also for bool
  double as_float() const;  // also for int and bool
  const std::string& as_string() const { return std::get<std::string>(v_); }
  const ListData& as_list() const { return *std::get<std::shared_ptr<const ListData>>(v_); }
  const DictData& as_dict() const { return *std::get<std::shared_ptr<const DictData>>(v_); }
  const std::shared_ptr<ObjectData>& as_object() const {
    return std::get<std::shared_ptr<ObjectData>>(v_);
  }
  const FunctionData& as_function() const {
    return *std::get<std::shared_ptr<const FunctionData>>(v_);
  }
  // Precondition: is_undefined().
  const std::string& undefined_message() const { return std::get<Undefined>(v_).message; }
  // Throws this undefined value's error. Precondition: is_undefined().
  [[noreturn]] void fail_undefined() const;

  // Nesting depth: 0 for scalars.
  int depth() const;

 private:
  struct Undefined {
    std::string message;
  };
  struct None {};
  std::variant<Undefined, None, bool, int64_t, double, std::string, std::shared_ptr<const ListData>,
               std::shared_ptr<const DictData>, std::shared_ptr<ObjectData>,
               std::shared_ptr<const FunctionData>>
      v_;
};

// Arguments of a call: f(a, b, key=c).
struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;

  // Binds the arguments to parameters `names` (positional or by keyword, Python style).
  // Absent ones come back empty; more than `names`, an unknown keyword or fewer than
  // `required` throw a TypeError-like RenderError naming `function`.
  std::vector<std::optional<Value>> bind(std::string_view function,
                                         std::initializer_list<std::string_view> names,
                                         size_t required = 0) const;
};

// Python's bool(x) (undefined is false).
bool truthy(const Value& v);
// Python's str(x), as Jinja prints it: undefined is "".
std::string to_str(const Value& v);
// Python's repr(x).
std::string repr(const Value& v);
// Python's type name: "str", "int", "NoneType", "list", ...
std::string type_name(const Value& v);
// Jinja's name of a value's type in "has no attribute" messages: "dict object", "None".
std::string object_type_repr(const Value& v);
// Python's x == y (1 == 1.0 == True; a list never equals a tuple).
bool equals(const Value& a, const Value& b);
// Python's ordering of numbers, strings and same-kind sequences: -1, 0 or 1. Throws a
// TypeError-like RenderError naming `op` for other pairs.
int compare(const Value& a, const Value& b, std::string_view op);
// Python's len(x) for str (code points), list, dict and undefined (0); throws otherwise.
int64_t length(const Value& v);
// The items of a for loop over `v`: a list's items, a dict's keys, a string's characters;
// undefined gives none. Throws for what Python cannot iterate.
std::vector<Value> iterate(const Value& v);

// Python's repr of a float: "1.0", "0.1", "1e-05", "1e+16".
std::string format_float(double d);

struct JsonOptions {
  std::optional<std::string> indent;  // None: one line
  std::string item_separator = ", ";
  std::string key_separator = ": ";
  bool sort_keys = false;
  bool ensure_ascii = false;
};
// Python's json.dumps(v, ...) with `options`; throws for values JSON cannot hold.
std::string to_json(const Value& v, const JsonOptions& options);

// Converts parsed JSON to a Value (objects keep the order the JSON type keeps). Throws when
// the data nests deeper than kMaxValueDepth.
Value from_json(const nlohmann::json& j);
Value from_json(const nlohmann::ordered_json& j);

}  // namespace tessera::chat::jinja
