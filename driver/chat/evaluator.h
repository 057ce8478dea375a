// Runs a parsed template: Jinja's scoping (a for-loop iteration, a macro call, a {% with %}
// have their own variables; {% if %} has none), loops with `loop.*`, macros, namespaces, and
// the globals transformers gives templates (raise_exception, strftime_now) beside Jinja's
// (range, namespace, dict).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "driver/chat/ast.h"
#include "driver/chat/value.h"

namespace tessera::chat::jinja {

// Bounds on one render, so that no template (a loop over range(10**9), a macro calling itself,
// a string doubled in a loop) can hang or exhaust the process.
struct RenderLimits {
  int64_t max_loop_iterations = 1'000'000;  // all loops of the render together
  int max_call_depth = 50;                  // nested macro calls
  int64_t max_steps = 50'000'000;           // statements and expressions evaluated
  size_t max_output_bytes = kMaxStringBytes;
  uint64_t max_string_work = uint64_t{1} << 30;  // bytes of strings built, all together
};

// Renders `tmpl` with `context` (variable name, value) as its top-level variables. Throws
// RenderError: raise_exception's message as is, Python's or Jinja's message for other errors.
std::string render_template(const Template& tmpl,
                            const std::vector<std::pair<std::string, Value>>& context,
                            const RenderLimits& limits = {});

}  // namespace tessera::chat::jinja
