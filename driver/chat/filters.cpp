// Jinja's builtin filters and tests, with transformers' tojson (json.dumps, ensure_ascii off).
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>

#include "driver/chat/builtins.h"
#include "driver/chat/operators.h"
#include "driver/chat/py_string.h"

namespace tessera::chat::jinja {
namespace {

using Args = CallArgs;

std::string str_arg(const std::optional<Value>& v, std::string fallback) {
  return v ? to_str(*v) : fallback;
}

bool bool_arg(const std::optional<Value>& v) { return v && truthy(*v); }

int64_t int_arg(const std::optional<Value>& v, int64_t fallback) {
  if (!v || v->is_none()) return fallback;
  if (!v->is_int() && !v->is_bool()) {
    throw RenderError("'" + type_name(*v) + "' object cannot be interpreted as an integer");
  }
  return v->as_int();
}

// " " * n, as Python builds it (negative n gives "").
std::string spaces(int64_t n) {
  if (n > static_cast<int64_t>(kMaxStringBytes)) throw RenderError("string too long");
  return std::string(n > 0 ? n : 0, ' ');
}

// The items a filter iterates, each looked up by `attribute` ("a.b" or "0") when given.
Value attribute_of(const Value& item, const std::optional<Value>& attribute) {
  if (!attribute || attribute->is_none()) return item;
  if (attribute->is_int()) return get_item(item, *attribute);
  Value v = item;
  std::string path = to_str(*attribute);
  size_t start = 0;
  while (start <= path.size()) {
    size_t dot = path.find('.', start);
    std::string part =
        path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    bool numeric = !part.empty() && std::all_of(part.begin(), part.end(),
                                                [](char c) { return c >= '0' && c <= '9'; });
    v = numeric ? get_item(v, Value::integer(std::atoll(part.c_str())))
                : get_item(v, Value::string(part));
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return v;
}

// Jinja's case-insensitive sort key: strings lowered unless case_sensitive.
Value sort_key(const Value& v, bool case_sensitive) {
  if (!case_sensitive && v.is_string()) return Value::string(py::lower(v.as_string()));
  return v;
}

// ---- filters -----------------------------------------------------------------------------

Value f_abs(const Value& in, Args& a) {
  a.bind("abs", {});
  if (in.is_float()) return Value::number(std::fabs(in.as_float()));
  if (in.is_number()) return in.as_int() < 0 ? unary_op(Op::kNeg, in) : Value::integer(in.as_int());
  throw RenderError("bad operand type for abs(): '" + type_name(in) + "'");
}

Value f_attr(const Value& in, Args& a) {
  auto b = a.bind("attr", {"name"}, 1);
  return get_attr(in, to_str(*b[0]));
}

Value f_capitalize(const Value& in, Args& a) {
  a.bind("capitalize", {});
  return Value::string(py::capitalize(to_str(in)));
}

Value f_default(const Value& in, Args& a) {
  auto b = a.bind("default", {"default_value", "boolean"});
  bool use_default = in.is_undefined() || (bool_arg(b[1]) && !truthy(in));
  if (!use_default) return in;
  return b[0] ? *b[0] : Value::string("");
}

Value f_dictsort(const Value& in, Args& a) {
  auto b = a.bind("dictsort", {"case_sensitive", "by", "reverse"});
  if (!in.is_dict()) throw RenderError("dictsort expects a dict, got " + type_name(in));
  bool by_value = b[1] && to_str(*b[1]) == "value";
  std::vector<Value> items;
  for (const auto& [k, v] : in.as_dict().items)
    items.push_back(Value::list({Value::string(k), v}, true));
  bool cs = bool_arg(b[0]);
  std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
    size_t i = by_value ? 1 : 0;
    return compare(sort_key(x.as_list().items[i], cs), sort_key(y.as_list().items[i], cs), "<") < 0;
  });
  if (bool_arg(b[2])) std::reverse(items.begin(), items.end());
  return Value::list(std::move(items));
}

Value f_escape(const Value& in, Args& a) {
  a.bind("escape", {});
  std::string out;
  for (char c : to_str(in)) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return Value::string(std::move(out));
}

Value f_first(const Value& in, Args& a) {
  a.bind("first", {});
  std::vector<Value> items = iterate(in);
  if (items.empty()) return Value::undefined("No first item, sequence was empty.");
  return items.front();
}

Value f_last(const Value& in, Args& a) {
  a.bind("last", {});
  if (!in.is_undefined() && !in.is_string() && !in.is_list() && !in.is_dict()) {
    throw RenderError("'" + type_name(in) + "' object is not reversible");
  }
  std::vector<Value> items = iterate(in);
  if (items.empty()) return Value::undefined("No last item, sequence was empty.");
  return items.back();
}

Value f_float(const Value& in, Args& a) {
  auto b = a.bind("float", {"default"});
  if (in.is_undefined()) in.fail_undefined();
  if (in.is_number()) return Value::number(in.as_float());
  if (in.is_string()) {
    std::string s = py::strip(in.as_string(), std::nullopt, true, true);
    char* end = nullptr;
    double d = std::strtod(s.c_str(), &end);
    if (!s.empty() && end == s.c_str() + s.size()) return Value::number(d);
  }
  return b[0] ? *b[0] : Value::number(0.0);
}

Value f_format(const Value& in, Args& a) {
  if (!a.keyword.empty()) throw RenderError("format filter: keyword arguments are not supported");
  return binary_op(Op::kMod, Value::string(to_str(in)), Value::list(a.positional, true));
}

Value f_indent(const Value& in, Args& a) {
  auto b = a.bind("indent", {"width", "first", "blank"});
  std::string indention = b[0] && b[0]->is_string() ? b[0]->as_string() : spaces(int_arg(b[0], 4));
  // Jinja appends "\n" to the input with +=, so only strings are accepted.
  if (in.is_undefined()) in.fail_undefined();
  if (!in.is_string()) {
    throw RenderError(in.is_list() ? "'" + type_name(in) + "' object has no attribute 'splitlines'"
                                   : "unsupported operand type(s) for +=: '" + type_name(in) +
                                         "' and 'str'");
  }
  std::string text = in.as_string() + "\n";
  std::vector<std::string> lines = py::splitlines(text, false);
  std::string out;
  for (size_t i = 0; i < lines.size(); ++i) {
    if (i > 0) out += "\n";
    bool indent = i > 0 && (bool_arg(b[2]) || !lines[i].empty());
    out += (indent ? indention : "") + lines[i];
  }
  if (bool_arg(b[1])) out = indention + out;
  return Value::string(std::move(out));
}

Value f_int(const Value& in, Args& a) {
  auto b = a.bind("int", {"default", "base"});
  if (in.is_undefined()) in.fail_undefined();
  Value fallback = b[0] ? *b[0] : Value::integer(0);
  if (in.is_float()) {
    double d = std::trunc(in.as_float());
    if (!std::isfinite(d) || std::fabs(d) > 9.2e18) return fallback;
    return Value::integer(static_cast<int64_t>(d));
  }
  if (in.is_number()) return Value::integer(in.as_int());
  if (!in.is_string()) return fallback;
  std::string s = py::strip(in.as_string(), std::nullopt, true, true);
  s.erase(std::remove(s.begin(), s.end(), '_'), s.end());
  char* end = nullptr;
  errno = 0;
  int64_t base = int_arg(b[1], 10);
  if (base != 0 && (base < 2 || base > 36)) {
    throw RenderError("int() base must be >= 2 and <= 36, or 0");
  }
  long long v = std::strtoll(s.c_str(), &end, static_cast<int>(base));
  if (!s.empty() && end == s.c_str() + s.size() && errno == 0) return Value::integer(v);
  double d = std::strtod(s.c_str(), &end);
  if (!s.empty() && end == s.c_str() + s.size() && std::isfinite(d) && std::fabs(d) < 9.2e18) {
    return Value::integer(static_cast<int64_t>(d));
  }
  return fallback;
}

Value f_items(const Value& in, Args& a) {
  a.bind("items", {});
  if (in.is_undefined()) return Value::list({});
  if (!in.is_dict()) throw RenderError("Can only get item pairs from a mapping.");
  std::vector<Value> out;
  for (const auto& [k, v] : in.as_dict().items)
    out.push_back(Value::list({Value::string(k), v}, true));
  return Value::list(std::move(out));
}

Value f_join(const Value& in, Args& a) {
  auto b = a.bind("join", {"d", "attribute"});
  std::string sep = str_arg(b[0], "");
  std::string out;
  bool first = true;
  for (const Value& item : iterate(in)) {
    if (!first) out += sep;
    out += to_str(attribute_of(item, b[1]));
    first = false;
    if (out.size() > kMaxStringBytes) throw RenderError("string too long");
  }
  return Value::string(std::move(out));
}

Value f_length(const Value& in, Args& a) {
  a.bind("length", {});
  return Value::integer(length(in));
}

Value f_list(const Value& in, Args& a) {
  a.bind("list", {});
  return Value::list(iterate(in));
}

Value f_lower(const Value& in, Args& a) {
  a.bind("lower", {});
  return Value::string(py::lower(to_str(in)));
}

Value f_upper(const Value& in, Args& a) {
  a.bind("upper", {});
  return Value::string(py::upper(to_str(in)));
}

Value f_map(const Value& in, Args& a) {
  std::vector<Value> out;
  if (a.positional.empty()) {  // map(attribute="x", default=...)
    std::optional<Value> attribute, fallback;
    for (const auto& [k, v] : a.keyword) {
      if (k == "attribute") {
        attribute = v;
      } else if (k == "default") {
        fallback = v;
      } else {
        throw RenderError("Unexpected keyword argument '" + k + "'");
      }
    }
    if (!attribute) throw RenderError("map requires a filter argument");
    for (const Value& item : iterate(in)) {
      Value v = attribute_of(item, attribute);
      out.push_back(v.is_undefined() && fallback ? *fallback : v);
    }
    return Value::list(std::move(out));
  }
  std::string name = to_str(a.positional[0]);
  Builtin<FilterFn> filter = find_filter(name);
  if (!filter.fn) throw RenderError("No filter named '" + name + "' (or not supported).");
  for (const Value& item : iterate(in)) {
    Args rest{std::vector<Value>(a.positional.begin() + 1, a.positional.end()), a.keyword};
    out.push_back(filter.fn(item, rest));
  }
  return Value::list(std::move(out));
}

Value min_max(const Value& in, Args& a, bool want_max) {
  auto b = a.bind(want_max ? "max" : "min", {"case_sensitive", "attribute"});
  std::vector<Value> items = iterate(in);
  if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
  bool cs = bool_arg(b[0]);
  const Value* best = &items[0];
  for (const Value& item : items) {
    if (&item == best) continue;  // one item is never compared, as in Python
    int c = compare(sort_key(attribute_of(item, b[1]), cs), sort_key(attribute_of(*best, b[1]), cs),
                    want_max ? ">" : "<");
    if (want_max ? c > 0 : c < 0) best = &item;
  }
  return *best;
}
Value f_max(const Value& in, Args& a) { return min_max(in, a, true); }
Value f_min(const Value& in, Args& a) { return min_max(in, a, false); }

// select/reject/selectattr/rejectattr: `args` holds [attribute,] [test name, test args...].
Value select_items(const Value& in, Args& a, bool by_attr, bool keep) {
  std::vector<Value> rest = a.positional;
  std::optional<Value> attribute;
  if (by_attr) {
    if (rest.empty()) throw RenderError("Missing parameter for attribute name");
    attribute = rest.front();
    rest.erase(rest.begin());
  }
  TestFn test = nullptr;
  if (!rest.empty()) {
    std::string name = to_str(rest.front());
    rest.erase(rest.begin());
    test = find_test(name).fn;
    if (!test) throw RenderError("No test named '" + name + "' (or not supported).");
  }
  std::vector<Value> out;
  for (const Value& item : iterate(in)) {
    Value v = attribute_of(item, attribute);
    Args test_args{rest, a.keyword};
    bool pass = test ? test(v, test_args) : truthy(v);
    if (pass == keep) out.push_back(item);
  }
  return Value::list(std::move(out));
}
Value f_select(const Value& in, Args& a) { return select_items(in, a, false, true); }
Value f_reject(const Value& in, Args& a) { return select_items(in, a, false, false); }
Value f_selectattr(const Value& in, Args& a) { return select_items(in, a, true, true); }
Value f_rejectattr(const Value& in, Args& a) { return select_items(in, a, true, false); }

Value f_replace(const Value& in, Args& a) {
  auto b = a.bind("replace", {"old", "new", "count"}, 2);
  int64_t count = int_arg(b[2], -1);
  return Value::string(py::replace(to_str(in), to_str(*b[0]), to_str(*b[1]), count));
}

Value f_reverse(const Value& in, Args& a) {
  a.bind("reverse", {});
  if (in.is_string()) {
    std::u32string d = py::decode(in.as_string());
    std::reverse(d.begin(), d.end());
    return Value::string(py::encode(d));
  }
  std::vector<Value> items = iterate(in);
  std::reverse(items.begin(), items.end());
  return Value::list(std::move(items));
}

Value f_round(const Value& in, Args& a) {
  auto b = a.bind("round", {"precision", "method"});
  int64_t precision = std::clamp<int64_t>(int_arg(b[0], 0), -400, 400);
  std::string method = str_arg(b[1], "common");
  if (in.is_undefined()) in.fail_undefined();
  if (!in.is_number()) {
    throw RenderError("type " + type_name(in) + " doesn't define __round__ method");
  }
  if (!in.is_float() && method == "common") {  // Python's round(int, n): an int, halves to even
    int64_t x = in.as_int();
    if (precision >= 0 || precision < -18) return Value::integer(precision >= 0 ? x : 0);
    int64_t factor = 1;
    for (int64_t i = 0; i < -precision; ++i) factor *= 10;
    int64_t q = x / factor - ((x % factor != 0 && x < 0) ? 1 : 0);  // floor
    int64_t r = x - q * factor;
    if (2 * r > factor || (2 * r == factor && q % 2 != 0)) ++q;
    return binary_op(Op::kMul, Value::integer(q), Value::integer(factor));
  }
  double scale = std::pow(10.0, static_cast<double>(precision));
  double x = in.as_float() * scale;
  if (method == "common") {
    x = std::nearbyint(x);  // Python's round(): halves go to even
  } else if (method == "ceil") {
    x = std::ceil(x);
  } else if (method == "floor") {
    x = std::floor(x);
  } else {
    throw RenderError("method must be common, ceil or floor");
  }
  return Value::number(x / scale);
}

Value f_safe(const Value& in, Args& a) {
  a.bind("safe", {});
  return Value::string(to_str(in));
}

Value f_sort(const Value& in, Args& a) {
  auto b = a.bind("sort", {"reverse", "case_sensitive", "attribute"});
  std::vector<Value> items = iterate(in);
  bool cs = bool_arg(b[1]);
  bool rev = bool_arg(b[0]);
  std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
    int c = compare(sort_key(attribute_of(x, b[2]), cs), sort_key(attribute_of(y, b[2]), cs), "<");
    return rev ? c > 0 : c < 0;
  });
  return Value::list(std::move(items));
}

Value f_string(const Value& in, Args& a) {
  a.bind("string", {});
  return Value::string(to_str(in));
}

Value f_sum(const Value& in, Args& a) {
  auto b = a.bind("sum", {"attribute", "start"});
  Value total = b[1] ? *b[1] : Value::integer(0);
  for (const Value& item : iterate(in))
    total = binary_op(Op::kAdd, total, attribute_of(item, b[0]));
  return total;
}

// Jinja's title filter: words begin after whitespace, '-', '(', '{', '[' or '<'.
Value f_title(const Value& in, Args& a) {
  a.bind("title", {});
  std::string out;
  bool word_start = true;
  for (char32_t c : py::decode(to_str(in))) {
    bool separator = py::is_space(c) || c == '-' || c == '(' || c == '{' || c == '[' || c == '<';
    std::u32string one(1, c);
    out += separator    ? py::encode(one)
           : word_start ? py::upper(py::encode(one))
                        : py::lower(py::encode(one));
    word_start = separator;
  }
  return Value::string(std::move(out));
}

// transformers' tojson: json.dumps(x, ensure_ascii=False, indent=None, separators=None,
// sort_keys=False).
Value f_tojson(const Value& in, Args& a) {
  auto b = a.bind("tojson", {"ensure_ascii", "indent", "separators", "sort_keys"});
  JsonOptions options;
  options.ensure_ascii = bool_arg(b[0]);
  options.sort_keys = bool_arg(b[3]);
  if (b[1] && !b[1]->is_none()) {
    if (b[1]->is_string()) {
      options.indent = b[1]->as_string();
    } else {
      options.indent = spaces(int_arg(b[1], 0));
    }
    options.item_separator = ",";
  }
  if (b[2] && !b[2]->is_none()) {
    if (!b[2]->is_list() || b[2]->as_list().items.size() != 2) {
      throw RenderError("tojson: separators must be a pair of strings");
    }
    options.item_separator = to_str(b[2]->as_list().items[0]);
    options.key_separator = to_str(b[2]->as_list().items[1]);
  }
  return Value::string(to_json(in, options));
}

Value f_trim(const Value& in, Args& a) {
  auto b = a.bind("trim", {"chars"});
  std::optional<std::string> chars;
  if (b[0] && !b[0]->is_none()) chars = to_str(*b[0]);
  return Value::string(py::strip(to_str(in), chars, true, true));
}

Value f_unique(const Value& in, Args& a) {
  auto b = a.bind("unique", {"case_sensitive", "attribute"});
  std::vector<Value> out, seen;
  for (const Value& item : iterate(in)) {
    Value key = sort_key(attribute_of(item, b[1]), bool_arg(b[0]));
    if (std::none_of(seen.begin(), seen.end(), [&](const Value& s) { return equals(s, key); })) {
      seen.push_back(key);
      out.push_back(item);
    }
  }
  return Value::list(std::move(out));
}

// ---- tests -------------------------------------------------------------------------------

bool t_defined(const Value& v, Args&) { return !v.is_undefined(); }
bool t_undefined(const Value& v, Args&) { return v.is_undefined(); }
bool t_none(const Value& v, Args&) { return v.is_none(); }
bool t_boolean(const Value& v, Args&) { return v.is_bool(); }
bool t_true(const Value& v, Args&) { return v.is_bool() && v.as_bool(); }
bool t_false(const Value& v, Args&) { return v.is_bool() && !v.as_bool(); }
bool t_integer(const Value& v, Args&) { return v.is_int(); }
bool t_float(const Value& v, Args&) { return v.is_float(); }
bool t_number(const Value& v, Args&) { return v.is_number(); }
bool t_string(const Value& v, Args&) { return v.is_string(); }
bool t_mapping(const Value& v, Args&) { return v.is_dict(); }
bool t_callable(const Value& v, Args&) { return v.is_function(); }
bool t_escaped(const Value&, Args&) { return false; }
bool t_iterable(const Value& v, Args&) {
  return v.is_undefined() || v.is_string() || v.is_list() || v.is_dict();
}
bool t_sequence(const Value& v, Args& a) { return t_iterable(v, a); }
bool t_lower(const Value& v, Args&) {
  std::string s = to_str(v);
  return py::lower(s) == s && py::upper(s) != s;
}
bool t_upper(const Value& v, Args&) {
  std::string s = to_str(v);
  return py::upper(s) == s && py::lower(s) != s;
}
const Value& test_arg(Args& a, const char* name) {
  if (a.positional.empty() && a.keyword.empty()) {
    throw RenderError(std::string(name) + "() missing 1 required positional argument");
  }
  return a.positional.empty() ? a.keyword[0].second : a.positional[0];
}
bool t_eq(const Value& v, Args& a) { return equals(v, test_arg(a, "eq")); }
bool t_ne(const Value& v, Args& a) { return !equals(v, test_arg(a, "ne")); }
bool t_lt(const Value& v, Args& a) { return compare(v, test_arg(a, "lt"), "<") < 0; }
bool t_le(const Value& v, Args& a) { return compare(v, test_arg(a, "le"), "<=") <= 0; }
bool t_gt(const Value& v, Args& a) { return compare(v, test_arg(a, "gt"), ">") > 0; }
bool t_ge(const Value& v, Args& a) { return compare(v, test_arg(a, "ge"), ">=") >= 0; }
bool t_in(const Value& v, Args& a) { return contains(test_arg(a, "in"), v); }
bool t_odd(const Value& v, Args&) {
  return equals(binary_op(Op::kMod, v, Value::integer(2)), Value::integer(1));
}
bool t_even(const Value& v, Args&) {
  return equals(binary_op(Op::kMod, v, Value::integer(2)), Value::integer(0));
}
bool t_divisibleby(const Value& v, Args& a) {
  const Value& n = test_arg(a, "divisibleby");
  return truthy(binary_op(Op::kMod, v, n)) == false;
}
bool t_sameas(const Value& v, Args& a) {
  const Value& o = test_arg(a, "sameas");
  if (v.is_none() || o.is_none()) return v.is_none() && o.is_none();
  if (v.is_bool() || o.is_bool()) return v.is_bool() && o.is_bool() && v.as_bool() == o.as_bool();
  if (v.is_int() && o.is_int())
    return v.as_int() == o.as_int() && v.as_int() >= -5 && v.as_int() <= 256;
  if (v.is_object() && o.is_object()) return v.as_object() == o.as_object();
  return false;
}
bool t_filter(const Value& v, Args&) { return v.is_string() && find_filter(v.as_string()).fn; }
bool t_test(const Value& v, Args&) { return v.is_string() && find_test(v.as_string()).fn; }

// Jinja builtins not implemented here: known names, so a template that has them in a branch it
// never takes still renders.
constexpr std::string_view kOtherJinjaFilters[] = {
    "batch",     "center", "filesizeformat", "forceescape", "groupby",
    "pprint",    "random", "slice",          "striptags",   "truncate",
    "urlencode", "urlize", "wordcount",      "wordwrap",    "xmlattr"};

}  // namespace

Builtin<FilterFn> find_filter(std::string_view name) {
  static const std::pair<std::string_view, FilterFn> kFilters[] = {
      {"abs", f_abs},
      {"attr", f_attr},
      {"capitalize", f_capitalize},
      {"count", f_length},
      {"d", f_default},
      {"default", f_default},
      {"dictsort", f_dictsort},
      {"e", f_escape},
      {"escape", f_escape},
      {"first", f_first},
      {"float", f_float},
      {"format", f_format},
      {"indent", f_indent},
      {"int", f_int},
      {"items", f_items},
      {"join", f_join},
      {"last", f_last},
      {"length", f_length},
      {"list", f_list},
      {"lower", f_lower},
      {"map", f_map},
      {"max", f_max},
      {"min", f_min},
      {"reject", f_reject},
      {"rejectattr", f_rejectattr},
      {"replace", f_replace},
      {"reverse", f_reverse},
      {"round", f_round},
      {"safe", f_safe},
      {"select", f_select},
      {"selectattr", f_selectattr},
      {"sort", f_sort},
      {"string", f_string},
      {"sum", f_sum},
      {"title", f_title},
      {"tojson", f_tojson},
      {"trim", f_trim},
      {"unique", f_unique},
      {"upper", f_upper},
  };
  for (const auto& [n, fn] : kFilters) {
    if (n == name) return {true, fn};
  }
  for (std::string_view n : kOtherJinjaFilters) {
    if (n == name) return {true, nullptr};
  }
  return {};
}

Builtin<TestFn> find_test(std::string_view name) {
  static const std::pair<std::string_view, TestFn> kTests[] = {
      {"boolean", t_boolean},
      {"callable", t_callable},
      {"defined", t_defined},
      {"divisibleby", t_divisibleby},
      {"eq", t_eq},
      {"equalto", t_eq},
      {"==", t_eq},
      {"escaped", t_escaped},
      {"even", t_even},
      {"false", t_false},
      {"filter", t_filter},
      {"float", t_float},
      {"ge", t_ge},
      {">=", t_ge},
      {"gt", t_gt},
      {"greaterthan", t_gt},
      {">", t_gt},
      {"in", t_in},
      {"integer", t_integer},
      {"iterable", t_iterable},
      {"le", t_le},
      {"<=", t_le},
      {"lower", t_lower},
      {"lt", t_lt},
      {"lessthan", t_lt},
      {"<", t_lt},
      {"mapping", t_mapping},
      {"ne", t_ne},
      {"!=", t_ne},
      {"none", t_none},
      {"number", t_number},
      {"odd", t_odd},
      {"sameas", t_sameas},
      {"sequence", t_sequence},
      {"string", t_string},
      {"test", t_test},
      {"true", t_true},
      {"undefined", t_undefined},
      {"upper", t_upper},
  };
  for (const auto& [n, fn] : kTests) {
    if (n == name) return {true, fn};
  }
  return {};
}

}  // namespace tessera::chat::jinja
