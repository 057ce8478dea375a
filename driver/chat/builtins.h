// What templates call: Jinja's filters and tests, and Python's attribute and item access
// (including the methods of str, dict and list that the sandbox allows).
#pragma once

#include <optional>
#include <string>
#include <string_view>

#include "driver/chat/value.h"

namespace tessera::chat::jinja {

// A filter (`x | name(args)`) and a test (`x is name(args)`). Both throw RenderError.
using FilterFn = Value (*)(const Value& input, CallArgs& args);
using TestFn = bool (*)(const Value& input, CallArgs& args);

// Where a name stands: implemented here (fn set), a Jinja builtin this renderer does not
// implement (known, no fn: an error only when a render reaches it), or no Jinja builtin at
// all (a syntax error, as in Jinja).
template <typename Fn>
struct Builtin {
  bool known = false;
  Fn fn = nullptr;
};
Builtin<FilterFn> find_filter(std::string_view name);
Builtin<TestFn> find_test(std::string_view name);

// Jinja's sandboxed getattr(obj, name): a Python attribute first (a bound method such as
// str.strip or dict.items; mutating methods are refused as unsafe), then an item. Missing
// gives undefined; an undefined `obj` throws its error.
Value get_attr(const Value& obj, const std::string& name);
// Jinja's getitem(obj, key): an item first, then (for string keys) an attribute.
Value get_item(const Value& obj, const Value& key);
// obj[start:stop:step] for str, list and tuple; absent bounds are Python's defaults.
Value get_slice(const Value& obj, const std::optional<Value>& start,
                const std::optional<Value>& stop, const std::optional<Value>& step);

}  // namespace tessera::chat::jinja
