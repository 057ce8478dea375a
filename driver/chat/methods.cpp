// Attribute and item access, and the methods of str, dict and list that templates call
// (message.content.strip(), tool.items(), ...), as Jinja's ImmutableSandboxedEnvironment
// allows them.
#include <algorithm>

#include "driver/chat/builtins.h"
#include "driver/chat/py_string.h"

namespace tessera::chat::jinja {
namespace {

using Args = CallArgs;

std::optional<std::string> opt_string(const std::optional<Value>& v, const char* method) {
  if (!v || v->is_none()) return std::nullopt;
  if (!v->is_string()) {
    throw RenderError(std::string(method) + " arg must be None or str");
  }
  return v->as_string();
}

int64_t opt_int(const std::optional<Value>& v, int64_t fallback) {
  if (!v || v->is_none()) return fallback;
  if (!v->is_int() && !v->is_bool()) {
    throw RenderError("'" + type_name(*v) + "' object cannot be interpreted as an integer");
  }
  return v->as_int();
}

const std::string& string_arg(const Value& v, const char* what) {
  if (!v.is_string()) {
    std::string prefix = *what ? std::string(what) + " " : "";
    throw RenderError(prefix + "must be str, not " + type_name(v));
  }
  return v.as_string();
}

Value string_list(std::vector<std::string> parts) {
  std::vector<Value> items;
  items.reserve(parts.size());
  for (auto& p : parts) items.push_back(Value::string(std::move(p)));
  return Value::list(std::move(items));
}

// str.startswith / str.endswith: a prefix or a tuple of them.
bool affix_matches(const std::string& s, const Value& affix, bool prefix) {
  auto one = [&](const Value& v) {
    const std::string& a = string_arg(v, prefix ? "startswith first arg" : "endswith first arg");
    if (a.size() > s.size()) return false;
    return prefix ? s.compare(0, a.size(), a) == 0
                  : s.compare(s.size() - a.size(), a.size(), a) == 0;
  };
  if (affix.is_list() && affix.as_list().tuple) {
    return std::any_of(affix.as_list().items.begin(), affix.as_list().items.end(), one);
  }
  return one(affix);
}

template <typename Pred>
bool all_chars(const std::string& s, Pred pred) {
  std::u32string d = py::decode(s);
  return !d.empty() && std::all_of(d.begin(), d.end(), pred);
}

// The str methods a template may call, by name; each takes the string and the call's arguments.
using StringMethod = std::function<Value(const std::string&, Args&)>;
using StringMethods = std::vector<std::pair<std::string_view, StringMethod>>;

// strip, lstrip, rstrip, split, rsplit, splitlines and join: cutting a string up and joining
// strings.
StringMethods cutting_methods() {
  return {
      {"strip",
       [](const std::string& s, Args& a) {
         auto b = a.bind("strip", {"chars"});
         return Value::string(py::strip(s, opt_string(b[0], "strip"), true, true));
       }},
      {"lstrip",
       [](const std::string& s, Args& a) {
         auto b = a.bind("lstrip", {"chars"});
         return Value::string(py::strip(s, opt_string(b[0], "lstrip"), true, false));
       }},
      {"rstrip",
       [](const std::string& s, Args& a) {
         auto b = a.bind("rstrip", {"chars"});
         return Value::string(py::strip(s, opt_string(b[0], "rstrip"), false, true));
       }},
      {"split",
       [](const std::string& s, Args& a) {
         auto b = a.bind("split", {"sep", "maxsplit"});
         return string_list(py::split(s, opt_string(b[0], "split"), opt_int(b[1], -1)));
       }},
      {"rsplit",
       [](const std::string& s, Args& a) {
         auto b = a.bind("rsplit", {"sep", "maxsplit"});
         return string_list(py::rsplit(s, opt_string(b[0], "rsplit"), opt_int(b[1], -1)));
       }},
      {"splitlines",
       [](const std::string& s, Args& a) {
         auto b = a.bind("splitlines", {"keepends"});
         return string_list(py::splitlines(s, b[0] && truthy(*b[0])));
       }},
      {"join",
       [](const std::string& s, Args& a) {
         auto b = a.bind("join", {"iterable"}, 1);
         std::string out;
         bool first = true;
         for (const Value& v : iterate(*b[0])) {
           if (!v.is_string()) {
             throw RenderError("sequence item: expected str instance, " + type_name(v) + " found");
           }
           if (!first) out += s;
           out += v.as_string();
           first = false;
           if (out.size() > kMaxStringBytes) throw RenderError("string too long");
         }
         return Value::string(std::move(out));
       }},
  };
}

// startswith, endswith, find, rfind, index, rindex and count: where a substring is.
StringMethods searching_methods() {
  return {
      {"startswith",
       [](const std::string& s, Args& a) {
         auto b = a.bind("startswith", {"prefix"}, 1);
         return Value::boolean(affix_matches(s, *b[0], true));
       }},
      {"endswith",
       [](const std::string& s, Args& a) {
         auto b = a.bind("endswith", {"suffix"}, 1);
         return Value::boolean(affix_matches(s, *b[0], false));
       }},
      {"find",
       [](const std::string& s, Args& a) {
         auto b = a.bind("find", {"sub"}, 1);
         return Value::integer(py::find(s, string_arg(*b[0], ""), false));
       }},
      {"rfind",
       [](const std::string& s, Args& a) {
         auto b = a.bind("rfind", {"sub"}, 1);
         return Value::integer(py::find(s, string_arg(*b[0], ""), true));
       }},
      {"index",
       [](const std::string& s, Args& a) {
         auto b = a.bind("index", {"sub"}, 1);
         int64_t i = py::find(s, string_arg(*b[0], ""), false);
         if (i < 0) throw RenderError("substring not found");
         return Value::integer(i);
       }},
      {"rindex",
       [](const std::string& s, Args& a) {
         auto b = a.bind("rindex", {"sub"}, 1);
         int64_t i = py::find(s, string_arg(*b[0], ""), true);
         if (i < 0) throw RenderError("substring not found");
         return Value::integer(i);
       }},
      {"count",
       [](const std::string& s, Args& a) {
         auto b = a.bind("count", {"sub"}, 1);
         return Value::integer(py::count(s, string_arg(*b[0], "")));
       }},
  };
}

// upper, lower, casefold, title, capitalize, replace, removeprefix and removesuffix: a new
// string from this one.
StringMethods rewriting_methods() {
  return {
      {"upper",
       [](const std::string& s, Args& a) {
         a.bind("upper", {});
         return Value::string(py::upper(s));
       }},
      {"lower",
       [](const std::string& s, Args& a) {
         a.bind("lower", {});
         return Value::string(py::lower(s));
       }},
      {"casefold",
       [](const std::string& s, Args& a) {
         a.bind("casefold", {});
         return Value::string(py::lower(s));
       }},
      {"title",
       [](const std::string& s, Args& a) {
         a.bind("title", {});
         return Value::string(py::title(s));
       }},
      {"capitalize",
       [](const std::string& s, Args& a) {
         a.bind("capitalize", {});
         return Value::string(py::capitalize(s));
       }},
      {"replace",
       [](const std::string& s, Args& a) {
         auto b = a.bind("replace", {"old", "new", "count"}, 2);
         return Value::string(py::replace(s, string_arg(*b[0], "replace() argument 1"),
                                          string_arg(*b[1], "replace() argument 2"),
                                          opt_int(b[2], -1)));
       }},
      {"removeprefix",
       [](const std::string& s, Args& a) {
         auto b = a.bind("removeprefix", {"prefix"}, 1);
         const std::string& p = string_arg(*b[0], "removeprefix() argument");
         return Value::string(s.compare(0, p.size(), p) == 0 ? s.substr(p.size()) : s);
       }},
      {"removesuffix",
       [](const std::string& s, Args& a) {
         auto b = a.bind("removesuffix", {"suffix"}, 1);
         const std::string& p = string_arg(*b[0], "removesuffix() argument");
         bool match =
             !p.empty() && p.size() <= s.size() && s.compare(s.size() - p.size(), p.size(), p) == 0;
         return Value::string(match ? s.substr(0, s.size() - p.size()) : s);
       }},
  };
}

// isdigit, isspace and isalpha: a test of every character.
StringMethods testing_methods() {
  return {
      {"isdigit",
       [](const std::string& s, Args& a) {
         a.bind("isdigit", {});
         return Value::boolean(all_chars(s, [](char32_t c) { return c >= '0' && c <= '9'; }));
       }},
      {"isspace",
       [](const std::string& s, Args& a) {
         a.bind("isspace", {});
         return Value::boolean(py::all_space(s));
       }},
      {"isalpha",
       [](const std::string& s, Args& a) {
         a.bind("isalpha", {});
         return Value::boolean(all_chars(s, [](char32_t c) {
           return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c >= 0xC0;
         }));
       }},
  };
}

// A Python str method bound to `s`, or nothing when str has no such (safe) method.
std::optional<Value> string_method(const std::string& s, const std::string& name) {
  static const StringMethods kMethods = [] {
    StringMethods all;
    for (StringMethods group :
         {cutting_methods(), searching_methods(), rewriting_methods(), testing_methods()}) {
      for (auto& method : group) all.push_back(std::move(method));
    }
    return all;
  }();
  for (const auto& [method, fn] : kMethods) {
    if (method == name) {
      const StringMethod* f = &fn;
      return Value::function(name, "method", [s, f](Args& args) { return (*f)(s, args); });
    }
  }
  return std::nullopt;
}

std::optional<Value> dict_method(const Value& dict, const std::string& name) {
  if (name == "items" || name == "keys" || name == "values") {
    return Value::function(
        name, "method",
        [dict, name](Args& args) {
          args.bind(name, {});
          std::vector<Value> out;
          for (const auto& [k, v] : dict.as_dict().items) {
            if (name == "items") {
              out.push_back(Value::list({Value::string(k), v}, true));
            } else {
              out.push_back(name == "keys" ? Value::string(k) : v);
            }
          }
          return Value::list(std::move(out));
        },
        dict.depth() + 1);
  }
  if (name == "get") {
    return Value::function(
        name, "method",
        [dict](Args& args) {
          auto b = args.bind("get", {"key", "default"}, 1);
          const Value* v = b[0]->is_string() ? dict.as_dict().find(b[0]->as_string()) : nullptr;
          if (v != nullptr) return *v;
          return b[1] ? *b[1] : Value::none();
        },
        dict.depth() + 1);
  }
  if (name == "copy") {
    return Value::function(
        name, "method",
        [dict](Args& args) {
          args.bind("copy", {});
          return dict;
        },
        dict.depth() + 1);
  }
  return std::nullopt;
}

std::optional<Value> list_method(const Value& list, const std::string& name) {
  if (name == "index" || name == "count") {
    return Value::function(
        name, "method",
        [list, name](Args& args) {
          auto b = args.bind(name, {"value"}, 1);
          const auto& items = list.as_list().items;
          int64_t hits = 0;
          for (size_t i = 0; i < items.size(); ++i) {
            if (!equals(items[i], *b[0])) continue;
            if (name == "index") return Value::integer(static_cast<int64_t>(i));
            ++hits;
          }
          if (name == "index") throw RenderError(repr(*b[0]) + " is not in list");
          return Value::integer(hits);
        },
        list.depth() + 1);
  }
  return std::nullopt;
}

bool is_unsafe(const Value& obj, const std::string& name) {
  static const char* kDict[] = {"clear", "pop", "popitem", "setdefault", "update"};
  static const char* kList[] = {"append", "clear",  "extend",  "insert",
                                "pop",    "remove", "reverse", "sort"};
  if (obj.is_dict()) return std::find(std::begin(kDict), std::end(kDict), name) != std::end(kDict);
  if (obj.is_list() && !obj.as_list().tuple) {
    return std::find(std::begin(kList), std::end(kList), name) != std::end(kList);
  }
  return false;
}

Value missing_attr(const Value& obj, const std::string& name) {
  return Value::undefined("'" + object_type_repr(obj) + "' has no attribute '" + name + "'");
}

// An attribute in Python's sense (not an item).
std::optional<Value> python_attr(const Value& obj, const std::string& name) {
  if (is_unsafe(obj, name)) {
    throw RenderError("access to attribute '" + name + "' of '" + type_name(obj) +
                      "' object is unsafe.");
  }
  switch (obj.kind()) {
    case Value::Kind::kString:
      return string_method(obj.as_string(), name);
    case Value::Kind::kDict:
      return dict_method(obj, name);
    case Value::Kind::kList:
      return list_method(obj, name);
    case Value::Kind::kObject:
      if (const Value* v = obj.as_object()->find(name)) return *v;
      return std::nullopt;
    default:
      return std::nullopt;
  }
}

std::optional<int64_t> as_index(const Value& key) {
  if (key.is_int() || key.is_bool()) return key.as_int();
  return std::nullopt;
}

}  // namespace

Value get_attr(const Value& obj, const std::string& name) {
  if (obj.is_undefined()) obj.fail_undefined();
  if (auto attr = python_attr(obj, name)) return *attr;
  if (obj.is_dict()) {
    if (const Value* v = obj.as_dict().find(name)) return *v;
  }
  return missing_attr(obj, name);
}

Value get_item(const Value& obj, const Value& key) {
  if (obj.is_undefined()) obj.fail_undefined();
  if (obj.is_dict() && key.is_string()) {
    if (const Value* v = obj.as_dict().find(key.as_string())) return *v;
  }
  if (obj.is_list() || obj.is_string()) {
    if (auto index = as_index(key)) {
      int64_t size = obj.is_list() ? static_cast<int64_t>(obj.as_list().items.size())
                                   : static_cast<int64_t>(py::length(obj.as_string()));
      int64_t i = *index < 0 ? *index + size : *index;
      if (i >= 0 && i < size) {
        if (obj.is_list()) return obj.as_list().items[i];
        return Value::string(py::slice(obj.as_string(), py::SliceIndices{i, 1, 1}));
      }
    }
  }
  if (key.is_string()) {
    if (auto attr = python_attr(obj, key.as_string())) return *attr;
    return missing_attr(obj, key.as_string());
  }
  return Value::undefined(object_type_repr(obj) + " has no element " + repr(key));
}

Value get_slice(const Value& obj, const std::optional<Value>& start,
                const std::optional<Value>& stop, const std::optional<Value>& step) {
  if (obj.is_undefined()) obj.fail_undefined();
  auto bound = [](const std::optional<Value>& v) -> std::optional<int64_t> {
    if (!v || v->is_none()) return std::nullopt;
    if (!v->is_int() && !v->is_bool()) {
      throw RenderError("slice indices must be integers or None or have an __index__ method");
    }
    return v->as_int();
  };
  int64_t step_value = bound(step).value_or(1);
  if (step_value == 0) throw RenderError("slice step cannot be zero");
  if (obj.is_string()) {
    const std::string& s = obj.as_string();
    auto indices = py::resolve_slice(static_cast<int64_t>(py::length(s)), bound(start), bound(stop),
                                     step_value);
    return Value::string(py::slice(s, indices));
  }
  if (obj.is_list()) {
    const ListData& l = obj.as_list();
    auto indices = py::resolve_slice(static_cast<int64_t>(l.items.size()), bound(start),
                                     bound(stop), step_value);
    std::vector<Value> out;
    out.reserve(indices.count);
    for (int64_t k = 0; k < indices.count; ++k) {
      out.push_back(l.items[indices.start + k * indices.step]);
    }
    return Value::list(std::move(out), l.tuple);
  }
  // Jinja subscripts slices directly (not through its getitem), so Python's errors show.
  if (obj.is_dict()) throw RenderError("unhashable type: 'slice'");
  throw RenderError("'" + type_name(obj) + "' object is not subscriptable");
}

}  // namespace tessera::chat::jinja
