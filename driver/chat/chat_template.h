// Chat templates: the Jinja `chat_template` of a Hugging Face tokenizer_config.json, rendered
// exactly as transformers' `apply_chat_template(messages, tokenize=False,
// add_generation_prompt=...)` renders it.
//
// transformers renders with Jinja2's ImmutableSandboxedEnvironment(trim_blocks=True,
// lstrip_blocks=True) plus the loopcontrols extension, its own `tojson` filter (json.dumps with
// ensure_ascii=False) and the globals raise_exception(message) and strftime_now(format). This
// renderer implements that environment over the Jinja subset chat templates use:
//  - {{ }}, {% %}, {# #}, {% raw %}, whitespace control with '-' and '+', trim_blocks and
//    lstrip_blocks;
//  - if/elif/else; for (with `else`, an `if` filter, unpacking `for k, v in ...`, loop.index,
//    index0, revindex, revindex0, first, last, length, previtem, nextitem, cycle()), break and
//    continue; set (names, unpacking, ns.attr on a namespace(), block set); macro (positional,
//    keyword and default arguments); with; filter blocks; {% generation %} (renders its body);
//  - literals (strings with Python escapes, ints, floats, true/false/none, lists, tuples,
//    dicts), attribute and item access, slices ([::-1], [1:]), calls, `~`, + - * / // % **,
//    comparisons (chained), in / not in, and / or / not, `x if c else y`;
//  - filters: abs attr capitalize count d default dictsort e escape first float format indent
//    int items join last length list lower map max min reject rejectattr replace reverse round
//    safe select selectattr sort string sum title tojson trim unique upper;
//  - tests: boolean callable defined divisibleby eq equalto escaped even false filter float ge
//    gt in integer iterable le lower lt mapping ne none number odd sameas sequence string test
//    true undefined upper (and ==, !=, <, <=, >, >=);
//  - str methods strip lstrip rstrip split rsplit splitlines startswith endswith upper lower
//    title capitalize replace find rfind index rindex count join removeprefix removesuffix
//    isdigit isalpha isspace casefold; dict methods items keys values get copy; list methods
//    index count (mutating methods are refused, as the sandbox refuses them).
// Values follow Python: undefined variables are Jinja's default Undefined (false, print as "",
// iterate as empty, `is defined` false; a missing key or attribute of a dict is undefined; but
// using an undefined as a value - arithmetic, its attribute, calling it - is an error, as in
// Jinja), integers are 64-bit (overflow is an error, not a big integer), str.upper/lower map
// Latin, Greek and Cyrillic letters only.
// Not implemented (a render that reaches them fails with a clear error; a template that has
// them in untaken branches still renders): the filters batch, center, filesizeformat,
// forceescape, groupby, pprint, random, slice, striptags, truncate, urlencode, urlize,
// wordcount, wordwrap, xmlattr; format with keyword arguments; recursive loops, loop.changed;
// call blocks; *args/**kwargs; include/import/extends. Filters that Jinja makes lazy (map,
// select, reverse, ...) return lists here, and dict.items() a list: only printing such an
// object directly shows a difference.
//
// Every render is bounded (loop iterations, macro depth, steps, output size), so no template
// can hang or crash the process. A ChatTemplate is immutable: copies share the parsed template
// and render() may run on many threads at once.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"

namespace tessera::chat {

namespace jinja {
struct Template;
}

struct ChatMessage {
  std::string role;  // "system", "user", "assistant", "tool"
  std::string content;
  // Passed as message.reasoning_content when set (Qwen3 puts it in <think></think>).
  std::optional<std::string> reasoning_content;
};

class ChatTemplate {
 public:
  // Reads the chat template of a tokenizer_config.json: its "chat_template" string (or the
  // entry named "default" of a list of named templates), or else a chat_template.jinja file in
  // the same folder (where newer transformers versions save it). The special tokens (bos, eos,
  // unk, sep, pad, cls, mask) may be strings or {"content": ...} objects; as in transformers,
  // the template sees those that are set, and a null one (Qwen3's bos_token) is undefined.
  // NOT_FOUND when the file or the template is missing; INVALID_ARGUMENT for bad JSON or a
  // template syntax error (naming line and column).
  static Expected<ChatTemplate> load(const std::string& tokenizer_config_path);

  // Parses template source; the template sees bos_token and eos_token as given.
  // INVALID_ARGUMENT "chat template syntax error: line L, column C: ..." for a syntax error,
  // an unknown tag, filter or test.
  static Expected<ChatTemplate> parse(std::string source, std::string bos_token,
                                      std::string eos_token);

  // Renders `messages` ({"role", "content"} dicts, plus reasoning_content when set). The
  // template sees messages, add_generation_prompt, the special tokens (see load and parse),
  // tools=None and documents=None as transformers passes them, and
  // every key of `extra_context` (a JSON object or null), e.g. {"enable_thinking": false} or
  // {"tools": [...]}; extra_context may not set messages or add_generation_prompt. It is an
  // ordered_json because key order shows in tojson output (tool schemas); a nlohmann::json
  // converts implicitly, with its keys sorted.
  // INVALID_ARGUMENT with the template's own message when it calls raise_exception(), or
  // Python's/Jinja's message for other errors (e.g. "'x' is undefined" used as a value).
  Expected<std::string> render(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                               const nlohmann::ordered_json& extra_context = {}) const;

  // The same from JSON (an OpenAI request's "messages" array: content may be a string, null or
  // a list of parts; tool_calls and any other keys pass through). ordered_json keeps object
  // keys in request order, which tojson output shows.
  Expected<std::string> render_json(const nlohmann::ordered_json& messages,
                                    bool add_generation_prompt,
                                    const nlohmann::ordered_json& extra_context = {}) const;

  const std::string& source() const;  // normalized as Jinja sees it
  // "" when not set.
  const std::string& bos_token() const;
  const std::string& eos_token() const;

 private:
  ChatTemplate() = default;
  const std::string& token(std::string_view name) const;

  std::shared_ptr<const jinja::Template> template_;
  // The special tokens the template sees: ("bos_token", "<s>"), ...
  std::vector<std::pair<std::string, std::string>> special_tokens_;
};

}  // namespace tessera::chat
