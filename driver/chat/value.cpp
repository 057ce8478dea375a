#include "driver/chat/value.h"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <unordered_map>

#include "driver/chat/py_string.h"

namespace tessera::chat::jinja {
namespace {

void check_depth(int depth) {
  if (depth > kMaxValueDepth) {
    throw RenderError("value nests deeper than " + std::to_string(kMaxValueDepth) + " levels");
  }
}

// Printing and comparing recurse over data; namespaces can form cycles, so every recursion
// carries its level and stops.
void check_level(int level) {
  if (level > kMaxValueDepth + 8) throw RenderError("value nests too deeply (a cycle?)");
}

std::string repr_at(const Value& v, int level);

std::string repr_items(const std::vector<Value>& items, int level) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i > 0) out += ", ";
    out += repr_at(items[i], level + 1);
    if (out.size() > kMaxStringBytes) throw RenderError("string too long");
  }
  return out;
}

std::string repr_pairs(const std::vector<std::pair<std::string, Value>>& items, int level) {
  std::string out = "{";
  for (size_t i = 0; i < items.size(); ++i) {
    if (i > 0) out += ", ";
    out += py::repr(items[i].first) + ": " + repr_at(items[i].second, level + 1);
    if (out.size() > kMaxStringBytes) throw RenderError("string too long");
  }
  return out + "}";
}

std::string repr_at(const Value& v, int level) {
  check_level(level);
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      return "Undefined";
    case Value::Kind::kString:
      return py::repr(v.as_string());
    case Value::Kind::kList: {
      const ListData& l = v.as_list();
      if (!l.tuple) return "[" + repr_items(l.items, level) + "]";
      return "(" + repr_items(l.items, level) + (l.items.size() == 1 ? ",)" : ")");
    }
    case Value::Kind::kDict:
      return repr_pairs(v.as_dict().items, level);
    case Value::Kind::kObject: {
      const ObjectData& o = *v.as_object();
      if (o.is_namespace) return "<Namespace " + repr_pairs(o.attrs, level) + ">";
      return "<" + o.type_name + ">";
    }
    case Value::Kind::kFunction: {
      const FunctionData& f = v.as_function();
      if (f.kind == "macro") return "<Macro '" + f.name + "'>";
      return std::string("<built-in ") + (f.kind == "method" ? "method " : "function ") + f.name +
             ">";
    }
    default:
      return to_str(v);
  }
}

bool equals_at(const Value& a, const Value& b, int level) {
  check_level(level);
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return a.as_float() == b.as_float();
    return a.as_int() == b.as_int();
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return true;
    case Value::Kind::kString:
      return a.as_string() == b.as_string();
    case Value::Kind::kList: {
      const ListData& x = a.as_list();
      const ListData& y = b.as_list();
      if (x.tuple != y.tuple || x.items.size() != y.items.size()) return false;
      for (size_t i = 0; i < x.items.size(); ++i) {
        if (!equals_at(x.items[i], y.items[i], level + 1)) return false;
      }
      return true;
    }
    case Value::Kind::kDict: {
      const DictData& x = a.as_dict();
      const DictData& y = b.as_dict();
      if (x.items.size() != y.items.size()) return false;
      for (const auto& [key, value] : x.items) {
        const Value* other = y.find(key);
        if (other == nullptr || !equals_at(value, *other, level + 1)) return false;
      }
      return true;
    }
    case Value::Kind::kObject:
      return a.as_object() == b.as_object();
    case Value::Kind::kFunction:
      return &a.as_function() == &b.as_function();
    default:
      return false;
  }
}

int compare_at(const Value& a, const Value& b, std::string_view op, int level) {
  check_level(level);
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) {
      double x = a.as_float(), y = b.as_float();
      return x < y ? -1 : (x > y ? 1 : 0);  // NaN compares as equal here; Python says False
    }
    int64_t x = a.as_int(), y = b.as_int();
    return x < y ? -1 : (x > y ? 1 : 0);
  }
  if (a.is_string() && b.is_string()) {
    int c = a.as_string().compare(b.as_string());  // UTF-8 byte order is code point order
    return c < 0 ? -1 : (c > 0 ? 1 : 0);
  }
  if (a.is_list() && b.is_list() && a.as_list().tuple == b.as_list().tuple) {
    const auto& x = a.as_list().items;
    const auto& y = b.as_list().items;
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (!equals_at(x[i], y[i], level + 1)) return compare_at(x[i], y[i], op, level + 1);
    }
    return x.size() < y.size() ? -1 : (x.size() > y.size() ? 1 : 0);
  }
  if (a.is_undefined()) a.fail_undefined();
  if (b.is_undefined()) b.fail_undefined();
  throw RenderError("'" + std::string(op) + "' not supported between instances of '" +
                    type_name(a) + "' and '" + type_name(b) + "'");
}

}  // namespace

const Value* DictData::find(std::string_view key) const {
  for (const auto& kv : items) {
    if (kv.first == key) return &kv.second;
  }
  return nullptr;
}

const Value* ObjectData::find(std::string_view name) const {
  for (const auto& kv : attrs) {
    if (kv.first == name) return &kv.second;
  }
  return nullptr;
}

void ObjectData::set(const std::string& name, Value value) {
  check_depth(value.depth() + 1);
  depth = std::max(depth, value.depth() + 1);
  for (auto& kv : attrs) {
    if (kv.first == name) {
      kv.second = std::move(value);
      return;
    }
  }
  attrs.emplace_back(name, std::move(value));
}

Value Value::undefined(std::string message) {
  Value v;
  v.v_ = Undefined{std::move(message)};
  return v;
}

Value Value::none() {
  Value v;
  v.v_ = None{};
  return v;
}

Value Value::boolean(bool b) {
  Value v;
  v.v_ = b;
  return v;
}

Value Value::integer(int64_t i) {
  Value v;
  v.v_ = i;
  return v;
}

Value Value::number(double d) {
  Value v;
  v.v_ = d;
  return v;
}

Value Value::string(std::string s) {
  if (s.size() > kMaxStringBytes) throw RenderError("string too long");
  Value v;
  v.v_ = std::move(s);
  return v;
}

Value Value::list(std::vector<Value> items, bool tuple) {
  if (items.size() > kMaxListItems) throw RenderError("list too long");
  auto data = std::make_shared<ListData>();
  for (const Value& item : items) data->depth = std::max(data->depth, item.depth() + 1);
  check_depth(data->depth);
  data->items = std::move(items);
  data->tuple = tuple;
  Value v;
  v.v_ = std::shared_ptr<const ListData>(std::move(data));
  return v;
}

Value Value::dict(std::vector<std::pair<std::string, Value>> items) {
  auto data = std::make_shared<DictData>();
  data->items.reserve(items.size());
  std::unordered_map<std::string, size_t> index;  // only for large dicts; small ones scan
  for (auto& kv : items) {
    data->depth = std::max(data->depth, kv.second.depth() + 1);
    Value* existing = nullptr;
    if (items.size() < 32) {
      for (auto& e : data->items) {
        if (e.first == kv.first) existing = &e.second;
      }
    } else if (auto it = index.find(kv.first); it != index.end()) {
      existing = &data->items[it->second].second;
    } else {
      index.emplace(kv.first, data->items.size());
    }
    if (existing != nullptr) {
      *existing = std::move(kv.second);  // a later duplicate key wins, as in Python
    } else {
      data->items.push_back(std::move(kv));
    }
  }
  check_depth(data->depth);
  Value v;
  v.v_ = std::shared_ptr<const DictData>(std::move(data));
  return v;
}

Value Value::object(std::shared_ptr<ObjectData> object) {
  check_depth(object->depth);
  Value v;
  v.v_ = std::move(object);
  return v;
}

Value Value::function(std::string name, std::string kind, std::function<Value(CallArgs&)> call,
                      int depth) {
  check_depth(depth);
  auto data = std::make_shared<FunctionData>();
  data->name = std::move(name);
  data->kind = std::move(kind);
  data->call = std::move(call);
  data->depth = depth;
  Value v;
  v.v_ = std::shared_ptr<const FunctionData>(std::move(data));
  return v;
}

int64_t Value::as_int() const {
  if (is_bool()) return as_bool() ? 1 : 0;
  return std::get<int64_t>(v_);
}

double Value::as_float() const {
  if (is_float()) return std::get<double>(v_);
  return static_cast<double>(as_int());
}

void Value::fail_undefined() const { throw RenderError(undefined_message()); }

int Value::depth() const {
  switch (kind()) {
    case Kind::kList:
      return as_list().depth;
    case Kind::kDict:
      return as_dict().depth;
    case Kind::kObject:
      return as_object()->depth;
    case Kind::kFunction:
      return as_function().depth;
    default:
      return 0;
  }
}

std::vector<std::optional<Value>> CallArgs::bind(std::string_view function,
                                                 std::initializer_list<std::string_view> names,
                                                 size_t required) const {
  std::vector<std::optional<Value>> out(names.size());
  if (positional.size() > names.size()) {
    throw RenderError(std::string(function) + "() takes at most " + std::to_string(names.size()) +
                      " argument(s) (" + std::to_string(positional.size()) + " given)");
  }
  for (size_t i = 0; i < positional.size(); ++i) out[i] = positional[i];
  for (const auto& [key, value] : keyword) {
    size_t index = 0;
    for (std::string_view name : names) {
      if (name == key) break;
      ++index;
    }
    if (index == names.size()) {
      throw RenderError(std::string(function) + "() got an unexpected keyword argument '" + key +
                        "'");
    }
    if (out[index]) {
      throw RenderError(std::string(function) + "() got multiple values for argument '" + key +
                        "'");
    }
    out[index] = value;
  }
  for (size_t i = 0; i < required; ++i) {
    if (!out[i]) {
      throw RenderError(std::string(function) + "() missing required argument '" +
                        std::string(names.begin()[i]) + "'");
    }
  }
  return out;
}

bool truthy(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return false;
    case Value::Kind::kBool:
      return v.as_bool();
    case Value::Kind::kInt:
      return v.as_int() != 0;
    case Value::Kind::kFloat:
      return v.as_float() != 0.0;
    case Value::Kind::kString:
      return !v.as_string().empty();
    case Value::Kind::kList:
      return !v.as_list().items.empty();
    case Value::Kind::kDict:
      return !v.as_dict().items.empty();
    default:
      return true;
  }
}

std::string to_str(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      return "";
    case Value::Kind::kNone:
      return "None";
    case Value::Kind::kBool:
      return v.as_bool() ? "True" : "False";
    case Value::Kind::kInt:
      return std::to_string(v.as_int());
    case Value::Kind::kFloat:
      return format_float(v.as_float());
    case Value::Kind::kString:
      return v.as_string();
    default:
      return repr_at(v, 0);
  }
}

std::string repr(const Value& v) { return repr_at(v, 0); }

std::string type_name(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      return "Undefined";
    case Value::Kind::kNone:
      return "NoneType";
    case Value::Kind::kBool:
      return "bool";
    case Value::Kind::kInt:
      return "int";
    case Value::Kind::kFloat:
      return "float";
    case Value::Kind::kString:
      return "str";
    case Value::Kind::kList:
      return v.as_list().tuple ? "tuple" : "list";
    case Value::Kind::kDict:
      return "dict";
    case Value::Kind::kObject:
      return v.as_object()->type_name;
    case Value::Kind::kFunction:
      return v.as_function().kind == "macro" ? "Macro" : "function";
  }
  return "object";
}

std::string object_type_repr(const Value& v) {
  if (v.is_none()) return "None";
  if (v.is_object()) return "jinja2.utils." + type_name(v) + " object";
  return type_name(v) + " object";
}

bool equals(const Value& a, const Value& b) { return equals_at(a, b, 0); }

int compare(const Value& a, const Value& b, std::string_view op) { return compare_at(a, b, op, 0); }

int64_t length(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      return 0;
    case Value::Kind::kString:
      return static_cast<int64_t>(py::length(v.as_string()));
    case Value::Kind::kList:
      return static_cast<int64_t>(v.as_list().items.size());
    case Value::Kind::kDict:
      return static_cast<int64_t>(v.as_dict().items.size());
    default:
      throw RenderError("object of type '" + type_name(v) + "' has no len()");
  }
}

std::vector<Value> iterate(const Value& v) {
  std::vector<Value> out;
  switch (v.kind()) {
    case Value::Kind::kUndefined:
      return out;
    case Value::Kind::kList:
      return v.as_list().items;
    case Value::Kind::kDict:
      out.reserve(v.as_dict().items.size());
      for (const auto& kv : v.as_dict().items) out.push_back(Value::string(kv.first));
      return out;
    case Value::Kind::kString: {
      std::u32string chars = py::decode(v.as_string());
      out.reserve(chars.size());
      for (char32_t c : chars) {
        std::string s;
        py::append_utf8(s, c);
        out.push_back(Value::string(std::move(s)));
      }
      return out;
    }
    default:
      throw RenderError("'" + type_name(v) + "' object is not iterable");
  }
}

std::string format_float(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  char buf[64];
  auto result = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  std::string sci(buf, result.ptr);  // "-1.2345e+02": the shortest digits that round-trip
  bool negative = sci[0] == '-';
  size_t e_pos = sci.find('e');
  std::string digits;
  for (size_t i = negative ? 1 : 0; i < e_pos; ++i) {
    if (sci[i] != '.') digits += sci[i];
  }
  int exponent = std::atoi(sci.c_str() + e_pos + 1);
  std::string out = negative ? "-" : "";
  if (exponent < -4 || exponent >= 16) {  // Python's repr switches to exponent notation here
    out += digits[0];
    if (digits.size() > 1) out += "." + digits.substr(1);
    char exp_buf[16];
    std::snprintf(exp_buf, sizeof(exp_buf), "e%c%02d", exponent < 0 ? '-' : '+',
                  std::abs(exponent));
    return out + exp_buf;
  }
  if (exponent < 0) {
    return out + "0." + std::string(-exponent - 1, '0') + digits;
  }
  size_t int_digits = static_cast<size_t>(exponent) + 1;
  if (digits.size() <= int_digits) {
    return out + digits + std::string(int_digits - digits.size(), '0') + ".0";
  }
  return out + digits.substr(0, int_digits) + "." + digits.substr(int_digits);
}

}  // namespace tessera::chat::jinja
