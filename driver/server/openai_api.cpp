#include "driver/server/openai_api.h"

#include <cmath>
#include <limits>

#include "common/tokenizer/tokenizer.h"
#include "driver/chat/chat_template.h"
#include "driver/server/tool_parser.h"

namespace tessera::server {

using nlohmann::json;

std::string error_body(const ApiError& e) {
  json err = {{"message", e.message},
              {"type", e.type},
              {"param", e.param.empty() ? json(nullptr) : json(e.param)},
              {"code", e.status}};
  return json{{"error", err}}.dump();
}

ApiError bad_request(std::string message, std::string param) {
  ApiError e;
  e.status = 400;
  e.message = std::move(message);
  e.param = std::move(param);
  return e;
}

namespace {

// A request body, as parse_request reads it: object keys in the client's order (see
// parse_request in openai_api.h).
using Body = nlohmann::ordered_json;

// The prompts of a request as they are parsed, before they become its Requests.
using Prompts = std::vector<std::vector<int32_t>>;

const char* type_name(const Body& v) {
  switch (v.type()) {
    case Body::value_t::null:
      return "null";
    case Body::value_t::boolean:
      return "a boolean";
    case Body::value_t::string:
      return "a string";
    case Body::value_t::array:
      return "an array";
    case Body::value_t::object:
      return "an object";
    default:
      return "a number";
  }
}

// Reads body[key] when present and not null; a wrong type is a 400 naming the field.
template <typename T>
std::optional<ApiError> field(const Body& body, const char* key, std::optional<T>& out) {
  auto it = body.find(key);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if constexpr (std::is_same_v<T, bool>) {
    if (!it->is_boolean()) {
      return bad_request(std::string(key) + " must be a boolean, got " + type_name(*it), key);
    }
    out = it->get<bool>();
  } else if constexpr (std::is_integral_v<T>) {
    if (!it->is_number_integer() &&
        !(it->is_number_float() && std::floor(it->get<double>()) == it->get<double>())) {
      return bad_request(std::string(key) + " must be an integer, got " + it->dump(), key);
    }
    const double v = it->get<double>();
    if (v < -9.0e15 || v > 9.0e15) {
      return bad_request(std::string(key) + " is out of range: " + it->dump(), key);
    }
    if constexpr (std::is_unsigned_v<T>) {
      if (v < 0) return bad_request(std::string(key) + " must not be negative", key);
      out = it->is_number_unsigned() ? it->get<T>() : static_cast<T>(v);
    } else {
      out = static_cast<T>(v);
    }
  } else if constexpr (std::is_floating_point_v<T>) {
    if (!it->is_number()) {
      return bad_request(std::string(key) + " must be a number, got " + type_name(*it), key);
    }
    out = static_cast<T>(it->get<double>());
  } else {
    if (!it->is_string()) {
      return bad_request(std::string(key) + " must be a string, got " + type_name(*it), key);
    }
    out = it->get<std::string>();
  }
  return std::nullopt;
}

#define TRY_FIELD(body, key, var)                                    \
  do {                                                               \
    if (auto e_ = field(body, key, var); e_.has_value()) return *e_; \
  } while (0)

bool is_int_array(const Body& v) {
  if (!v.is_array() || v.empty()) return false;
  for (const auto& x : v) {
    if (!x.is_number_integer()) return false;
  }
  return true;
}

std::optional<ApiError> token_ids(const Body& v, const ServedModel& m, std::vector<int32_t>& out) {
  for (const auto& x : v) {
    const int64_t id = x.get<int64_t>();
    if (id < 0 || id >= m.info.vocab_size) {
      return bad_request("token id " + std::to_string(id) + " is outside the vocabulary [0, " +
                             std::to_string(m.info.vocab_size) + ")",
                         "prompt");
    }
    out.push_back(static_cast<int32_t>(id));
  }
  return std::nullopt;
}

std::optional<ApiError> parse_prompts(const Body& body, const ServedModel& m, ApiRequest& out,
                                      Prompts& prompts) {
  auto it = body.find("prompt");
  if (it == body.end() || it->is_null()) return bad_request("prompt is required", "prompt");
  const Body& p = *it;
  auto add_text = [&](const std::string& text) {
    out.prompt_texts.push_back(text);
    prompts.push_back(m.tokenizer->encode(text, /*add_special_tokens=*/true));
  };
  if (p.is_string()) {
    add_text(p.get<std::string>());
  } else if (is_int_array(p)) {
    prompts.emplace_back();
    if (auto e = token_ids(p, m, prompts.back())) return e;
    out.prompt_texts.push_back(m.tokenizer->decode(prompts.back(), false));
  } else if (p.is_array() && !p.empty()) {
    for (const auto& one : p) {
      if (one.is_string()) {
        add_text(one.get<std::string>());
      } else if (is_int_array(one)) {
        prompts.emplace_back();
        if (auto e = token_ids(one, m, prompts.back())) return e;
        out.prompt_texts.push_back(m.tokenizer->decode(prompts.back(), false));
      } else {
        return bad_request(
            "prompt must be a string, a list of strings, a list of token ids or a list of lists "
            "of token ids",
            "prompt");
      }
    }
  } else {
    return bad_request(
        "prompt must be a non-empty string, list of strings, list of token ids or list of lists "
        "of token ids",
        "prompt");
  }
  if (prompts.size() > 1024) return bad_request("at most 1024 prompts per request", "prompt");
  return std::nullopt;
}

// The messages as the chat template takes them: key order kept, text parts joined.
std::optional<ApiError> template_messages(const Body& list, Body& messages) {
  messages = Body::array();
  for (const auto& msg : list) {
    if (!msg.is_object() || !msg.contains("role") || !msg["role"].is_string()) {
      return bad_request("each message must be an object with a string role", "messages");
    }
    Body one = msg;
    auto content = msg.find("content");
    if (content != msg.end() && content->is_array()) {
      // Text parts are joined with newlines (vLLM's default content format "string").
      std::string text;
      for (const auto& part : *content) {
        if (part.is_string()) {
          text += (text.empty() ? "" : "\n") + part.get<std::string>();
        } else if (part.is_object() && part.value("type", "") == "text" && part.contains("text") &&
                   part["text"].is_string()) {
          text += (text.empty() ? "" : "\n") + part["text"].get<std::string>();
        } else {
          return bad_request("only text content parts are supported (this model takes text)",
                             "messages");
        }
      }
      one["content"] = text;
    } else if (content != msg.end() && !content->is_string() && !content->is_null()) {
      return bad_request("message content must be a string, null or a list of parts", "messages");
    }
    messages.push_back(std::move(one));
  }
  return std::nullopt;
}

// tools and tool_choice: the tools go to the template (in `extra`); "auto" with tools asks for
// tool calls to be parsed (ApiRequest::parse_tools), which needs the server's tool-call parser.
std::optional<ApiError> parse_tools(const Body& body, const ServedModel& m, ApiRequest& out,
                                    Body& extra) {
  auto tools = body.find("tools");
  if (tools == body.end() || tools->is_null()) return std::nullopt;
  if (!tools->is_array()) return bad_request("tools must be a list of tools", "tools");
  std::string choice = "auto";
  if (auto c = body.find("tool_choice"); c != body.end() && !c->is_null()) {
    choice = c->is_string() ? c->get<std::string>() : "a named function";
  }
  if (choice == "auto" && !tools->empty()) {
    if (m.tool_call_parser.empty()) {
      return bad_request(
          "\"auto\" tool choice requires --enable-auto-tool-choice and --tool-call-parser to "
          "be set",
          "tool_choice");
    }
    out.parse_tools = true;
  } else if (choice != "none" && choice != "auto") {
    return bad_request("tool_choice " + choice + " is not supported: use \"auto\" or \"none\"",
                       "tool_choice");
  }
  extra["tools"] = *tools;
  return std::nullopt;
}

// messages (with add_generation_prompt, continue_final_message, chat_template_kwargs and tools)
// rendered by the chat template into the one prompt.
std::optional<ApiError> parse_messages(const Body& body, const ServedModel& m, ApiRequest& out,
                                       Prompts& prompts) {
  auto it = body.find("messages");
  if (it == body.end() || !it->is_array() || it->empty()) {
    return bad_request("messages must be a non-empty list of messages", "messages");
  }
  Body messages;
  if (auto e = template_messages(*it, messages)) return e;
  if (m.chat_template == nullptr) {
    return bad_request(
        "this model has no chat template (tokenizer_config.json has none): give one with "
        "--chat-template, or use /v1/completions");
  }
  std::optional<bool> add_generation_prompt, continue_final;
  TRY_FIELD(body, "add_generation_prompt", add_generation_prompt);
  TRY_FIELD(body, "continue_final_message", continue_final);
  Body extra = Body::object();
  if (auto kw = body.find("chat_template_kwargs"); kw != body.end() && !kw->is_null()) {
    if (!kw->is_object()) {
      return bad_request("chat_template_kwargs must be an object", "chat_template_kwargs");
    }
    extra = *kw;
    extra.erase("messages");
    extra.erase("add_generation_prompt");
  }
  if (auto e = parse_tools(body, m, out, extra)) return e;
  const bool gen_prompt = add_generation_prompt.value_or(!continue_final.value_or(false));
  auto rendered = m.chat_template->render_json(messages, gen_prompt, extra);
  if (!rendered) {
    return bad_request("the chat template failed: " + rendered.status().message(), "messages");
  }
  std::string text = *rendered;
  if (continue_final.value_or(false)) {
    // The last message stays open: cut the template's end-of-turn after its content.
    const auto& last = messages.back();
    if (last.contains("content") && last["content"].is_string()) {
      const std::string c = last["content"].get<std::string>();
      const size_t at = text.rfind(c);
      if (at != std::string::npos) text.resize(at + c.size());
    }
  }
  out.prompt_texts.push_back(text);
  // The template writes the special tokens itself.
  prompts.push_back(m.tokenizer->encode(text, /*add_special_tokens=*/false));
  return std::nullopt;
}

// The request's fields that set sampling and the answer's shape, each read with its type checked
// (absent or null: not set).
struct RequestFields {
  std::optional<double> temperature, top_p, min_p, presence, frequency, repetition;
  std::optional<int64_t> top_k, max_tokens, max_completion_tokens, n, best_of, min_tokens;
  std::optional<int64_t> logprobs_n, top_logprobs;
  std::optional<uint64_t> seed;
  std::optional<bool> stream, echo, ignore_eos, skip_special, include_stop, chat_logprobs;
};

std::optional<ApiError> read_fields(const Body& body, bool chat, RequestFields& f) {
  TRY_FIELD(body, "temperature", f.temperature);
  TRY_FIELD(body, "top_p", f.top_p);
  TRY_FIELD(body, "min_p", f.min_p);
  TRY_FIELD(body, "top_k", f.top_k);
  TRY_FIELD(body, "presence_penalty", f.presence);
  TRY_FIELD(body, "frequency_penalty", f.frequency);
  TRY_FIELD(body, "repetition_penalty", f.repetition);
  TRY_FIELD(body, "max_tokens", f.max_tokens);
  TRY_FIELD(body, "max_completion_tokens", f.max_completion_tokens);
  TRY_FIELD(body, "n", f.n);
  TRY_FIELD(body, "best_of", f.best_of);
  TRY_FIELD(body, "min_tokens", f.min_tokens);
  TRY_FIELD(body, "seed", f.seed);
  TRY_FIELD(body, "stream", f.stream);
  TRY_FIELD(body, "echo", f.echo);
  TRY_FIELD(body, "ignore_eos", f.ignore_eos);
  TRY_FIELD(body, "skip_special_tokens", f.skip_special);
  TRY_FIELD(body, "include_stop_str_in_output", f.include_stop);
  if (chat) {
    TRY_FIELD(body, "logprobs", f.chat_logprobs);
    TRY_FIELD(body, "top_logprobs", f.top_logprobs);
  } else {
    TRY_FIELD(body, "logprobs", f.logprobs_n);
  }
  return std::nullopt;
}

// model: one of the names served (or the model directory); 404 otherwise.
std::optional<ApiError> parse_model(const Body& body, const ServedModel& m, ApiRequest& out) {
  out.model = m.names.empty() ? m.root : m.names.front();
  std::optional<std::string> model;
  TRY_FIELD(body, "model", model);
  if (!model) return std::nullopt;
  bool known = *model == m.root;
  for (const auto& n : m.names) known |= *model == n;
  if (!known) {
    ApiError e;
    e.status = 404;
    e.type = "NotFoundError";
    e.message = "The model `" + *model + "` does not exist.";
    e.param = "model";
    return e;
  }
  out.model = *model;
  return std::nullopt;
}

// Sampling: generation_config.json's defaults, then the request's fields.
std::optional<ApiError> apply_sampling(const RequestFields& f, const GenerationDefaults& d,
                                       ApiRequest& out) {
  SamplingParams& s = out.sampling;
  if (d.temperature) s.temperature = static_cast<float>(*d.temperature);
  if (d.top_p) s.top_p = static_cast<float>(*d.top_p);
  if (d.top_k) s.top_k = static_cast<int>(*d.top_k);
  if (d.repetition_penalty) s.repetition_penalty = static_cast<float>(*d.repetition_penalty);
  if (f.temperature) s.temperature = static_cast<float>(*f.temperature);
  if (f.top_p) s.top_p = static_cast<float>(*f.top_p);
  if (f.min_p) s.min_p = static_cast<float>(*f.min_p);
  if (f.top_k) {
    // SamplingParams::validate judges the value as sent (and names it); above int's range is
    // "off" (at least the vocabulary), below it cannot be carried.
    if (*f.top_k < std::numeric_limits<int>::min()) {
      return bad_request("top_k is out of range: " + std::to_string(*f.top_k), "top_k");
    }
    s.top_k = static_cast<int>(std::min<int64_t>(*f.top_k, 1 << 30));
  }
  if (f.top_k && *f.top_k == 0) s.top_k = -1;  // vLLM treats 0 as off
  if (f.presence) s.presence_penalty = static_cast<float>(*f.presence);
  if (f.frequency) s.frequency_penalty = static_cast<float>(*f.frequency);
  if (f.repetition) s.repetition_penalty = static_cast<float>(*f.repetition);
  if (f.seed) s.seed = *f.seed;
  if (f.ignore_eos) s.ignore_eos = *f.ignore_eos;
  if (f.skip_special) s.skip_special_tokens = *f.skip_special;
  if (out.parse_tools) s.skip_special_tokens = false;  // <tool_call> may be a special token
  if (f.include_stop.value_or(false)) {
    return bad_request("include_stop_str_in_output is not supported", "include_stop_str_in_output");
  }
  if (f.min_tokens.value_or(0) != 0) {
    return bad_request("min_tokens is not supported", "min_tokens");
  }
  return std::nullopt;
}

// stream, echo, n (best_of only as n) and logprobs: completions' count, chat's flag with
// top_logprobs.
std::optional<ApiError> apply_choices(const RequestFields& f, bool chat, ApiRequest& out) {
  SamplingParams& s = out.sampling;
  out.stream = f.stream.value_or(false);
  out.echo = f.echo.value_or(false);
  if (f.n) {
    if (*f.n < 1 || *f.n > 128) return bad_request("n must be between 1 and 128", "n");
    out.n = static_cast<int>(*f.n);
  }
  if (f.best_of && *f.best_of != out.n) {
    return bad_request("best_of other than n is not supported", "best_of");
  }
  if (chat) {
    out.chat_logprobs = f.chat_logprobs.value_or(false);
    if (f.top_logprobs && !out.chat_logprobs) {
      return bad_request("top_logprobs needs logprobs: true", "top_logprobs");
    }
    if (out.chat_logprobs) {
      s.logprobs = static_cast<int>(std::clamp<int64_t>(f.top_logprobs.value_or(0), -1, 1 << 20));
    }
    if (f.top_logprobs && (*f.top_logprobs < 0 || *f.top_logprobs > kMaxLogprobs)) {
      return bad_request("top_logprobs must be between 0 and " + std::to_string(kMaxLogprobs),
                         "top_logprobs");
    }
  } else if (f.logprobs_n) {
    if (*f.logprobs_n < 0 || *f.logprobs_n > kMaxLogprobs) {
      return bad_request("logprobs must be between 0 and " + std::to_string(kMaxLogprobs),
                         "logprobs");
    }
    s.logprobs = static_cast<int>(*f.logprobs_n);
  }
  if (out.echo && s.logprobs >= 0) {
    return bad_request("echo with logprobs (prompt logprobs) is not supported", "echo");
  }
  return std::nullopt;
}

// stop: a string or a list of strings; stop_token_ids: integers.
std::optional<ApiError> parse_stop(const Body& body, const ServedModel& m, SamplingParams& s) {
  if (auto stop = body.find("stop"); stop != body.end() && !stop->is_null()) {
    if (stop->is_string()) {
      s.stop.push_back(stop->get<std::string>());
    } else if (stop->is_array()) {
      for (const auto& x : *stop) {
        if (!x.is_string())
          return bad_request("stop must be a string or a list of strings", "stop");
        s.stop.push_back(x.get<std::string>());
      }
    } else {
      return bad_request("stop must be a string or a list of strings", "stop");
    }
    std::erase_if(s.stop, [](const std::string& x) { return x.empty(); });
  }
  if (auto ids = body.find("stop_token_ids"); ids != body.end() && !ids->is_null()) {
    if (!ids->is_array()) return bad_request("stop_token_ids must be a list of integers");
    for (const auto& x : *ids) {
      if (!x.is_number_integer()) {
        return bad_request("stop_token_ids must be a list of integers", "stop_token_ids");
      }
      const int64_t id = x.get<int64_t>();
      if (id < 0 || id >= m.info.vocab_size) {
        return bad_request("stop token id " + std::to_string(id) + " is outside the vocabulary",
                           "stop_token_ids");
      }
      s.stop_token_ids.push_back(static_cast<int32_t>(id));
    }
  }
  return std::nullopt;
}

// max_tokens: the request's (max_completion_tokens wins), else 16 for completions (the OpenAI
// default) and the rest of the context for chat, capped by generation_config.json. The longest
// prompt and it must fit max_model_len.
std::optional<ApiError> parse_max_tokens(const RequestFields& f, bool chat, const ServedModel& m,
                                         const Prompts& prompts, ApiRequest& out) {
  size_t longest = 0;
  for (const auto& p : prompts) {
    if (p.empty()) return bad_request("the prompt is empty", chat ? "messages" : "prompt");
    longest = std::max(longest, p.size());
  }
  const int64_t room = m.info.max_model_len - static_cast<int64_t>(longest);
  std::optional<int64_t> asked = f.max_completion_tokens ? f.max_completion_tokens : f.max_tokens;
  if (asked && *asked < 1) {
    return bad_request("max_tokens must be at least 1, got " + std::to_string(*asked),
                       f.max_completion_tokens ? "max_completion_tokens" : "max_tokens");
  }
  if (room < 1 || (asked && *asked > room)) {
    return bad_request(
        "This model's maximum context length is " + std::to_string(m.info.max_model_len) +
            " tokens. However, you requested " +
            std::to_string(static_cast<int64_t>(longest) + asked.value_or(1)) + " tokens (" +
            std::to_string(longest) + " in the " + (chat ? "messages" : "prompt") + ", " +
            std::to_string(asked.value_or(1)) +
            " in the completion). Please reduce the length of the " +
            (chat ? "messages" : "prompt") + " or completion.",
        chat ? "messages" : "prompt");
  }
  int64_t max = asked ? *asked : (chat ? room : std::min<int64_t>(16, room));
  if (!asked && m.defaults.max_new_tokens) max = std::min(max, *m.defaults.max_new_tokens);
  out.sampling.max_tokens = static_cast<int>(std::min<int64_t>(max, 1 << 30));
  return std::nullopt;
}

// stream_options (with stream only): include_usage.
std::optional<ApiError> parse_stream_options(const Body& body, ApiRequest& out) {
  auto opts = body.find("stream_options");
  if (opts == body.end() || opts->is_null()) return std::nullopt;
  if (!out.stream) return bad_request("stream_options needs stream: true", "stream_options");
  if (!opts->is_object()) return bad_request("stream_options must be an object");
  std::optional<bool> usage;
  TRY_FIELD(*opts, "include_usage", usage);
  out.include_usage = usage.value_or(false);
  return std::nullopt;
}

}  // namespace

std::optional<ApiError> parse_request(const nlohmann::ordered_json& body, bool chat,
                                      const ServedModel& m, ApiRequest& out) {
  if (!body.is_object()) return bad_request("the request body must be a JSON object");
  out = ApiRequest{};
  out.chat = chat;
  if (auto e = parse_model(body, m, out)) return e;
  Prompts prompts;
  if (auto e =
          chat ? parse_messages(body, m, out, prompts) : parse_prompts(body, m, out, prompts)) {
    return e;
  }
  RequestFields f;
  if (auto e = read_fields(body, chat, f)) return e;
  if (auto e = apply_sampling(f, m.defaults, out)) return e;
  if (auto e = apply_choices(f, chat, out)) return e;
  if (auto e = parse_stop(body, m, out.sampling)) return e;
  if (auto e = parse_max_tokens(f, chat, m, prompts, out)) return e;
  if (auto e = parse_stream_options(body, out)) return e;
  // The driver's boundary (request.h): each prompt with the sampling parameters as one Request,
  // checked against the model once.
  for (auto& p : prompts) {
    auto r = Request::make(std::move(p), out.sampling, m.info);
    if (!r) return bad_request(r.status().message());
    out.requests.push_back(std::move(*r));
  }
  return std::nullopt;
}

std::string api_finish_reason(FinishReason reason) {
  if (reason == FinishReason::kLength || reason == FinishReason::kAbort) {
    return std::string(finish_reason_name(reason));
  }
  return "stop";
}

namespace {

std::string token_text(const ServedModel& m, int32_t id) {
  const int32_t one[1] = {id};
  return m.tokenizer->decode(one, false);
}

json bytes_of(const std::string& s) {
  json out = json::array();
  for (unsigned char c : s) out.push_back(static_cast<int>(c));
  return out;
}

// Logprobs in the shape the endpoint answers with, for `lps` (the tokens of one choice's text
// that starts at `text_offset`).
json logprobs_json(const ApiRequest& req, const ServedModel& m,
                   const std::vector<TokenLogprobs>& lps, size_t text_offset) {
  if (req.chat) {
    json content = json::array();
    for (const auto& lp : lps) {
      const std::string t = token_text(m, lp.token);
      json top = json::array();
      for (const auto& [id, v] : lp.top) {
        const std::string tt = token_text(m, id);
        top.push_back({{"token", tt}, {"logprob", v}, {"bytes", bytes_of(tt)}});
      }
      content.push_back(
          {{"token", t}, {"logprob", lp.logprob}, {"bytes", bytes_of(t)}, {"top_logprobs", top}});
    }
    return {{"content", content}};
  }
  json tokens = json::array(), token_logprobs = json::array(), top = json::array(),
       offsets = json::array();
  size_t offset = text_offset;
  for (const auto& lp : lps) {
    const std::string t = token_text(m, lp.token);
    tokens.push_back(t);
    token_logprobs.push_back(lp.logprob);
    json alts = json::object();
    for (const auto& [id, v] : lp.top) alts[token_text(m, id)] = v;
    top.push_back(alts);
    offsets.push_back(offset);
    offset += t.size();
  }
  return {{"tokens", tokens},
          {"token_logprobs", token_logprobs},
          {"top_logprobs", top},
          {"text_offset", offsets}};
}

}  // namespace

json usage_json(const std::vector<ChoiceResult>& choices, int n) {
  size_t prompt = 0, completion = 0, cached = 0;
  for (size_t i = 0; i < choices.size(); ++i) {
    if (i % static_cast<size_t>(n) == 0) {
      prompt += choices[i].prompt_tokens;
      cached += choices[i].cached_tokens;
    }
    completion += choices[i].tokens.size();
  }
  return {{"prompt_tokens", prompt},
          {"completion_tokens", completion},
          {"total_tokens", prompt + completion},
          {"prompt_tokens_details", {{"cached_tokens", cached}}}};
}

json completion_response(const ApiRequest& req, const std::string& id,
                         const std::vector<ChoiceResult>& choices, int64_t created,
                         const ServedModel& m) {
  json out_choices = json::array();
  for (size_t i = 0; i < choices.size(); ++i) {
    const ChoiceResult& c = choices[i];
    const bool want_logprobs = req.sampling.logprobs >= 0;
    if (req.chat) {
      json message = {{"role", "assistant"}, {"content", c.text}};
      std::string finish = api_finish_reason(c.finish_reason);
      if (req.parse_tools) {
        ToolOutput parsed = parse_hermes(c.text);
        message["content"] = parsed.content ? json(*parsed.content) : json(nullptr);
        if (!parsed.calls.empty()) {
          json calls = json::array();
          for (const ToolCall& t : parsed.calls) {
            calls.push_back({{"id", t.id},
                             {"type", "function"},
                             {"function", {{"name", t.name}, {"arguments", t.arguments}}}});
          }
          message["tool_calls"] = calls;
          finish = "tool_calls";
        }
      }
      out_choices.push_back(
          {{"index", i},
           {"message", message},
           {"logprobs", want_logprobs ? logprobs_json(req, m, c.logprobs, 0) : json(nullptr)},
           {"finish_reason", finish}});
    } else {
      const std::string prefix =
          req.echo ? req.prompt_texts[i / static_cast<size_t>(req.n)] : std::string();
      out_choices.push_back(
          {{"index", i},
           {"text", prefix + c.text},
           {"logprobs",
            want_logprobs ? logprobs_json(req, m, c.logprobs, prefix.size()) : json(nullptr)},
           {"finish_reason", api_finish_reason(c.finish_reason)},
           {"stop_reason", nullptr}});
    }
  }
  return {{"id", id},
          {"object", req.chat ? "chat.completion" : "text_completion"},
          {"created", created},
          {"model", req.model},
          {"choices", out_choices},
          {"usage", usage_json(choices, req.n)}};
}

json stream_chunk(const ApiRequest& req, const std::string& id, int index,
                  const std::string& delta_text, const std::vector<TokenLogprobs>& new_logprobs,
                  std::string_view finish_reason, bool first, int64_t created,
                  const ServedModel& m) {
  const bool want_logprobs = req.sampling.logprobs >= 0;
  const json finish = finish_reason.empty() ? json(nullptr) : json(std::string(finish_reason));
  json choice;
  if (req.chat) {
    json delta = json::object();
    if (first) delta["role"] = "assistant";
    if (!delta_text.empty() || first) delta["content"] = delta_text;
    choice = {{"index", index},
              {"delta", delta},
              {"logprobs", want_logprobs ? logprobs_json(req, m, new_logprobs, 0) : json(nullptr)},
              {"finish_reason", finish}};
  } else {
    choice = {{"index", index},
              {"text", delta_text},
              {"logprobs", want_logprobs ? logprobs_json(req, m, new_logprobs, 0) : json(nullptr)},
              {"finish_reason", finish},
              {"stop_reason", nullptr}};
  }
  return {{"id", id},
          {"object", req.chat ? "chat.completion.chunk" : "text_completion"},
          {"created", created},
          {"model", req.model},
          {"choices", json::array({choice})}};
}

json tool_call_chunk(const ApiRequest& req, const std::string& id, int index,
                     const std::vector<ToolCall>& calls, int first_index, int64_t created) {
  json list = json::array();
  for (size_t k = 0; k < calls.size(); ++k) {
    list.push_back({{"index", first_index + static_cast<int>(k)},
                    {"id", calls[k].id},
                    {"type", "function"},
                    {"function", {{"name", calls[k].name}, {"arguments", calls[k].arguments}}}});
  }
  json choice = {{"index", index},
                 {"delta", {{"tool_calls", list}}},
                 {"logprobs", nullptr},
                 {"finish_reason", nullptr}};
  return {{"id", id},
          {"object", "chat.completion.chunk"},
          {"created", created},
          {"model", req.model},
          {"choices", json::array({choice})}};
}

json usage_chunk(const ApiRequest& req, const std::string& id,
                 const std::vector<ChoiceResult>& choices, int64_t created) {
  return {{"id", id},
          {"object", req.chat ? "chat.completion.chunk" : "text_completion"},
          {"created", created},
          {"model", req.model},
          {"choices", json::array()},
          {"usage", usage_json(choices, req.n)}};
}

json models_response(const ServedModel& m) {
  json data = json::array();
  for (const auto& name : m.names) {
    data.push_back({{"id", name},
                    {"object", "model"},
                    {"created", m.created},
                    {"owned_by", "tessera"},
                    {"root", m.root},
                    {"parent", nullptr},
                    {"max_model_len", m.info.max_model_len}});
  }
  return {{"object", "list"}, {"data", data}};
}

}  // namespace tessera::server
