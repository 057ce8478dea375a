// The server's pure parts: OpenAI request JSON into prompts and SamplingParams (the one place a
// request is validated before the engine), responses, stream chunks, SSE framing, and the
// Prometheus text. With the real llama3 tokenizer and its chat template.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <sstream>

#include "common/tokenizer/tokenizer.h"
#include "driver/chat/chat_template.h"
#include "driver/server/metrics.h"
#include "driver/server/openai_api.h"

namespace tessera::server {
namespace {

using nlohmann::json;

// The token ids of a parsed request's prompts, in order.
std::vector<std::vector<int32_t>> prompts(const ApiRequest& r) {
  std::vector<std::vector<int32_t>> out;
  for (const Request& q : r.requests) out.push_back(q.prompt());
  return out;
}

class OpenAIApiTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::string dir = std::string(TESSERA_SOURCE_DIR) + "/tests/assets/tokenizers/llama3";
    auto t = Tokenizer::load(dir);
    ASSERT_TRUE(t) << t.status().to_string() << " (run scripts/fetch-test-assets)";
    tokenizer_ = t->release();
    auto c = chat::ChatTemplate::load(dir + "/tokenizer_config.json");
    ASSERT_TRUE(c) << c.status().to_string();
    template_ = new chat::ChatTemplate(std::move(*c));
  }
  static void TearDownTestSuite() {
    delete tokenizer_;
    delete template_;
  }
  ServedModel model() const {
    ServedModel m;
    m.names = {"tiny", "alias"};
    m.root = "/models/tiny";
    m.info.max_model_len = 64;
    m.info.vocab_size = 128256;
    m.tokenizer = tokenizer_;
    m.chat_template = template_;
    m.created = 1700000000;
    return m;
  }
  // Parses `body` (completions unless chat); the error, if any.
  std::optional<ApiError> parse(const json& body, ApiRequest& out, bool chat = false,
                                const ServedModel* m = nullptr) {
    ServedModel local = model();
    return parse_request(body, chat, m ? *m : local, out);
  }

  static inline Tokenizer* tokenizer_ = nullptr;
  static inline chat::ChatTemplate* template_ = nullptr;
};

TEST_F(OpenAIApiTest, EveryPromptFormIsAccepted) {
  ApiRequest r;
  ASSERT_FALSE(parse({{"prompt", "Hello there"}}, r));
  ASSERT_EQ(prompts(r).size(), 1u);
  EXPECT_EQ(prompts(r)[0], tokenizer_->encode("Hello there", true));
  ASSERT_FALSE(parse({{"prompt", {"a", "b", "c"}}}, r));
  EXPECT_EQ(prompts(r).size(), 3u);
  ASSERT_FALSE(parse({{"prompt", {1, 2, 3}}}, r));
  EXPECT_EQ(prompts(r), (std::vector<std::vector<int32_t>>{{1, 2, 3}}));
  ASSERT_FALSE(parse({{"prompt", {{1, 2}, {3}}}}, r));
  EXPECT_EQ(prompts(r).size(), 2u);
  EXPECT_EQ(r.model, "tiny");
  ASSERT_FALSE(parse({{"prompt", "x"}, {"model", "alias"}}, r));
  EXPECT_EQ(r.model, "alias");  // the response names the model the client asked for
  ASSERT_FALSE(parse({{"prompt", "x"}, {"model", "/models/tiny"}}, r));
}

TEST_F(OpenAIApiTest, DefaultsComeFromGenerationConfigAndTheRequestOverrides) {
  ServedModel m = model();
  m.defaults.temperature = 0.6;
  m.defaults.top_p = 0.9;
  m.defaults.top_k = 20;
  m.defaults.repetition_penalty = 1.1;
  ApiRequest r;
  ASSERT_FALSE(parse({{"prompt", "x"}}, r, false, &m));
  EXPECT_FLOAT_EQ(r.sampling.temperature, 0.6f);
  EXPECT_FLOAT_EQ(r.sampling.top_p, 0.9f);
  EXPECT_EQ(r.sampling.top_k, 20);
  EXPECT_FLOAT_EQ(r.sampling.repetition_penalty, 1.1f);
  EXPECT_EQ(r.sampling.max_tokens, 16);  // completions: OpenAI's default
  ASSERT_FALSE(
      parse({{"prompt", "x"}, {"temperature", 0}, {"top_k", 0}, {"top_p", 1}}, r, false, &m));
  EXPECT_TRUE(r.sampling.greedy());
  EXPECT_EQ(r.sampling.top_k, -1);  // 0 means off, as in vLLM
  // Chat: the rest of the context by default, capped by max_new_tokens.
  json chat = {{"messages", {{{"role", "user"}, {"content", "Hi"}}}}};
  ASSERT_FALSE(parse(chat, r, true, &m));
  EXPECT_EQ(r.sampling.max_tokens, 64 - static_cast<int>(prompts(r)[0].size()));
  m.defaults.max_new_tokens = 5;
  ASSERT_FALSE(parse(chat, r, true, &m));
  EXPECT_EQ(r.sampling.max_tokens, 5);
  chat["max_completion_tokens"] = 7;
  chat["max_tokens"] = 3;
  ASSERT_FALSE(parse(chat, r, true, &m));
  EXPECT_EQ(r.sampling.max_tokens, 7);  // max_completion_tokens wins
}

TEST_F(OpenAIApiTest, SamplingFieldsReachSamplingParams) {
  ApiRequest r;
  ASSERT_FALSE(parse({{"prompt", "x"},
                      {"top_p", 0.5},
                      {"min_p", 0.1},
                      {"seed", 42},
                      {"presence_penalty", 0.5},
                      {"frequency_penalty", -0.5},
                      {"stop", "END"},
                      {"stop_token_ids", {7, 8}},
                      {"ignore_eos", true},
                      {"skip_special_tokens", false},
                      {"logprobs", 3},
                      {"n", 2},
                      {"best_of", 2},
                      {"user", "someone"},
                      {"stream", true},
                      {"stream_options", {{"include_usage", true}}}},
                     r));
  EXPECT_FLOAT_EQ(r.sampling.top_p, 0.5f);
  EXPECT_FLOAT_EQ(r.sampling.min_p, 0.1f);
  EXPECT_EQ(r.sampling.seed, 42u);
  EXPECT_FLOAT_EQ(r.sampling.presence_penalty, 0.5f);
  EXPECT_FLOAT_EQ(r.sampling.frequency_penalty, -0.5f);
  EXPECT_EQ(r.sampling.stop, (std::vector<std::string>{"END"}));
  EXPECT_EQ(r.sampling.stop_token_ids, (std::vector<int32_t>{7, 8}));
  EXPECT_TRUE(r.sampling.ignore_eos);
  EXPECT_FALSE(r.sampling.skip_special_tokens);
  EXPECT_EQ(r.sampling.logprobs, 3);
  EXPECT_EQ(r.n, 2);
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
  // Chat's logprobs: a boolean, top_logprobs the count.
  ASSERT_FALSE(parse({{"messages", {{{"role", "user"}, {"content", "Hi"}}}},
                      {"logprobs", true},
                      {"top_logprobs", 4}},
                     r, true));
  EXPECT_EQ(r.sampling.logprobs, 4);
  EXPECT_TRUE(r.chat_logprobs);
}

TEST_F(OpenAIApiTest, BadFieldsAre400sNamingThem) {
  struct Case {
    json body;
    bool chat;
    int status;
    std::string param, says;
  };
  const json hi = {{{"role", "user"}, {"content", "Hi"}}};
  const std::vector<Case> cases = {
      {json::array(), false, 400, "", "JSON object"},
      {{{"max_tokens", 3}}, false, 400, "prompt", "prompt is required"},
      {{{"prompt", 5}}, false, 400, "prompt", "prompt must be"},
      {{{"prompt", {1, "a"}}}, false, 400, "prompt", "prompt must be"},
      {{{"prompt", {-1}}}, false, 400, "prompt", "outside the vocabulary"},
      {{{"prompt", "x"}, {"model", 3}}, false, 400, "model", "model must be a string"},
      {{{"prompt", "x"}, {"model", "nope"}}, false, 404, "model", "does not exist"},
      {{{"prompt", "x"}, {"temperature", "1"}}, false, 400, "temperature", "must be a number"},
      {{{"prompt", "x"}, {"temperature", -1}}, false, 400, "", "temperature"},
      {{{"prompt", "x"}, {"max_tokens", 1.5}}, false, 400, "max_tokens", "integer"},
      {{{"prompt", "x"}, {"max_tokens", 0}}, false, 400, "max_tokens", "at least 1"},
      {{{"prompt", "x"}, {"max_tokens", 100}},
       false,
       400,
       "prompt",
       "maximum context length is 64"},
      {{{"prompt", "x"}, {"n", 0}}, false, 400, "n", "n must be"},
      {{{"prompt", "x"}, {"best_of", 3}}, false, 400, "best_of", "best_of"},
      {{{"prompt", "x"}, {"logprobs", 21}}, false, 400, "logprobs", "between 0 and 20"},
      {{{"prompt", "x"}, {"echo", true}, {"logprobs", 1}}, false, 400, "echo", "echo"},
      {{{"prompt", "x"}, {"stop", {1}}}, false, 400, "stop", "stop must be"},
      {{{"prompt", "x"}, {"stop_token_ids", {999999999}}},
       false,
       400,
       "stop_token_ids",
       "outside the vocabulary"},
      {{{"prompt", "x"}, {"stream_options", {{"include_usage", true}}}},
       false,
       400,
       "stream_options",
       "needs stream"},
      {{{"prompt", "x"}, {"seed", -1}}, false, 400, "seed", "negative"},
      {{{"prompt", "x"}, {"ignore_eos", "yes"}}, false, 400, "ignore_eos", "boolean"},
      {{{"messages", json::array()}}, true, 400, "messages", "non-empty"},
      {{{"messages", {{{"content", "x"}}}}}, true, 400, "messages", "role"},
      {{{"messages", hi}, {"top_logprobs", 2}}, true, 400, "top_logprobs", "needs logprobs"},
      {{{"messages", hi}, {"logprobs", true}, {"top_logprobs", 30}},
       true,
       400,
       "top_logprobs",
       "between 0 and 20"},
      {{{"messages", hi}, {"chat_template_kwargs", 3}},
       true,
       400,
       "chat_template_kwargs",
       "object"},
  };
  for (const Case& c : cases) {
    ApiRequest r;
    auto e = parse(c.body, r, c.chat);
    ASSERT_TRUE(e.has_value()) << c.body.dump();
    EXPECT_EQ(e->status, c.status) << c.body.dump() << ": " << e->message;
    EXPECT_EQ(e->param, c.param) << c.body.dump() << ": " << e->message;
    EXPECT_NE(e->message.find(c.says), std::string::npos) << c.body.dump() << ": " << e->message;
    // The body clients read.
    json b = json::parse(error_body(*e));
    EXPECT_EQ(b["error"]["code"], c.status);
    EXPECT_EQ(b["error"]["message"], e->message);
  }
  // Both lengths in the context message.
  ApiRequest r;
  auto e = parse({{"prompt", "x"}, {"max_tokens", 100}}, r);
  ASSERT_TRUE(e);
  EXPECT_NE(e->message.find("(1 in the prompt, 100 in the completion)"), std::string::npos)
      << e->message;
  // Without a chat template, chat is refused with what to do.
  ServedModel m = model();
  m.chat_template = nullptr;
  e = parse({{"messages", {{{"role", "user"}, {"content", "Hi"}}}}}, r, true, &m);
  ASSERT_TRUE(e);
  EXPECT_NE(e->message.find("--chat-template"), std::string::npos);
}

// A bad top_k is named with the value the client sent (it used to say "got -2" for any).
TEST_F(OpenAIApiTest, ABadTopKSaysWhatWasSent) {
  for (int64_t k : {-2LL, -5LL, -1000LL, -2147483648LL}) {
    ApiRequest r;
    auto e = parse({{"prompt", "x"}, {"top_k", k}}, r);
    ASSERT_TRUE(e.has_value()) << k;
    EXPECT_EQ(e->status, 400);
    EXPECT_NE(e->message.find("top_k"), std::string::npos) << e->message;
    EXPECT_NE(e->message.find("got " + std::to_string(k)), std::string::npos) << e->message;
  }
  ApiRequest r;
  auto e = parse({{"prompt", "x"}, {"top_k", -1000000000000LL}}, r);
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->param, "top_k");
  EXPECT_NE(e->message.find("-1000000000000"), std::string::npos) << e->message;
  // -1 and 0 are off; a huge k is off too (at least the vocabulary).
  for (int64_t k : {-1LL, 0LL}) {
    ASSERT_FALSE(parse({{"prompt", "x"}, {"top_k", k}}, r)) << k;
    EXPECT_EQ(r.sampling.top_k, -1);
  }
  ASSERT_FALSE(parse({{"prompt", "x"}, {"top_k", 1000000000000LL}}, r));
  EXPECT_GE(r.sampling.top_k, 1 << 30);
  ASSERT_FALSE(parse({{"prompt", "x"}, {"top_k", 7}}, r));
  EXPECT_EQ(r.sampling.top_k, 7);
}

TEST_F(OpenAIApiTest, ToolsGoThroughTheTemplateAndAutoNeedsTheParser) {
  json tools = json::array({{{"type", "function"},
                             {"function",
                              {{"name", "get_weather"},
                               {"description", "Weather of a city"},
                               {"parameters", {{"type", "object"}}}}}}});
  json body = {{"messages", {{{"role", "user"}, {"content", "Weather in Paris?"}}}},
               {"tools", tools}};
  ApiRequest r;
  auto e = parse(body, r, true);
  ASSERT_TRUE(e);
  EXPECT_NE(e->message.find("--enable-auto-tool-choice"), std::string::npos);
  // Qwen3's template knows tools (it lists them in the system turn).
  const std::string qwen = std::string(TESSERA_SOURCE_DIR) + "/tests/assets/tokenizers/qwen3";
  auto qwen_tokenizer = Tokenizer::load(qwen);
  ASSERT_TRUE(qwen_tokenizer);
  auto qwen_template = chat::ChatTemplate::load(qwen + "/tokenizer_config.json");
  ASSERT_TRUE(qwen_template);
  ServedModel m = model();
  m.info.max_model_len = 4096;
  m.info.vocab_size = 151936;
  m.tokenizer = qwen_tokenizer->get();
  m.chat_template = &*qwen_template;
  m.tool_call_parser = "hermes";
  ASSERT_FALSE(parse(body, r, true, &m));
  EXPECT_TRUE(r.parse_tools);
  EXPECT_FALSE(r.sampling.skip_special_tokens);
  const std::string prompt = m.tokenizer->decode(prompts(r)[0], false);
  EXPECT_NE(prompt.find("\"name\": \"get_weather\""), std::string::npos) << prompt;
  EXPECT_NE(prompt.find("<tool_call>"), std::string::npos) << prompt;
  body["tool_choice"] = "none";
  ASSERT_FALSE(parse(body, r, true));
  EXPECT_FALSE(r.parse_tools);
  body["tool_choice"] = "required";
  e = parse(body, r, true, &m);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->param, "tool_choice");
  // A response whose text holds a call: tool_calls, no content, finish_reason tool_calls.
  body.erase("tool_choice");
  ASSERT_FALSE(parse(body, r, true, &m));
  ChoiceResult c;
  c.text =
      "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}</tool_call>";
  c.finish_reason = FinishReason::kStop;
  json j = completion_response(r, "chatcmpl-1", {c}, 1700000042, m);
  json msg = j["choices"][0]["message"];
  EXPECT_TRUE(msg["content"].is_null());
  ASSERT_EQ(msg["tool_calls"].size(), 1u);
  EXPECT_EQ(msg["tool_calls"][0]["type"], "function");
  EXPECT_EQ(msg["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(json::parse(msg["tool_calls"][0]["function"]["arguments"].get<std::string>()),
            json({{"city", "Paris"}}));
  EXPECT_EQ(j["choices"][0]["finish_reason"], "tool_calls");
}

// The template sees the request's objects with the client's key order, as vLLM and transformers
// render them (json.loads keeps it): a tool schema printed with tojson is the model's prompt, and
// models are trained on {"type": "function", "function": ...}, not on sorted keys.
TEST_F(OpenAIApiTest, TheTemplateSeesTheClientsKeyOrder) {
  auto printer = chat::ChatTemplate::parse(
      "{{ tools | tojson }}\n{{ messages | tojson }}\n{{ options | tojson }}", "", "");
  ASSERT_TRUE(printer) << printer.status().to_string();
  ServedModel m = model();
  m.info.max_model_len = 4096;
  m.chat_template = &*printer;
  m.tool_call_parser = "hermes";
  const std::string tools =
      R"([{"type": "function", "function": {"name": "get_weather", "description": "d", )"
      R"("parameters": {"type": "object", "properties": {"b": {"type": "string"}, )"
      R"("a": {"type": "integer"}}, "required": ["b"]}}}])";
  const std::string messages = R"([{"role": "user", "content": "Hi", "name": "zed"}])";
  const std::string options = R"({"zeta": 1, "alpha": {"y": 2, "x": 3}})";
  // The body as the server reads it: parsed from the client's text.
  const auto body =
      nlohmann::ordered_json::parse(R"({"messages": )" + messages + R"(, "tools": )" + tools +
                                    R"(, "chat_template_kwargs": {"options": )" + options + "}}");
  ApiRequest r;
  auto e = parse_request(body, /*chat=*/true, m, r);
  ASSERT_FALSE(e) << e->message;
  ASSERT_EQ(r.prompt_texts.size(), 1u);
  EXPECT_EQ(r.prompt_texts[0], tools + "\n" + messages + "\n" + options);
}

TEST_F(OpenAIApiTest, ChatRendersTheTemplateAndTextParts) {
  ApiRequest a, b;
  ASSERT_FALSE(parse({{"messages", {{{"role", "user"}, {"content", "Hi there"}}}}}, a, true));
  ASSERT_FALSE(parse(
      {{"messages", {{{"role", "user"}, {"content", {{{"type", "text"}, {"text", "Hi there"}}}}}}}},
      b, true));
  EXPECT_EQ(prompts(a), prompts(b));
  const std::string text = tokenizer_->decode(prompts(a)[0], false);
  EXPECT_EQ(text.rfind("<|begin_of_text|>", 0), 0u) << text;
  EXPECT_NE(text.find("Hi there<|eot_id|><|start_header_id|>assistant<|end_header_id|>"),
            std::string::npos)
      << text;
  // One BOS only: the template writes it, the tokenizer adds none.
  const std::vector<int32_t>& ids = a.requests.at(0).prompt();
  EXPECT_EQ(std::count(ids.begin(), ids.end(), 128000), 1);
}

TEST_F(OpenAIApiTest, ResponsesAndChunksHaveOpenAIsShape) {
  ServedModel m = model();
  ApiRequest r;
  ASSERT_FALSE(parse({{"prompt", {"a", "b"}}, {"n", 2}, {"echo", true}}, r));
  std::vector<ChoiceResult> choices(4);
  for (size_t i = 0; i < 4; ++i) {
    choices[i].text = "t" + std::to_string(i);
    choices[i].tokens.assign(i + 1, 5);
    choices[i].finish_reason = i == 0 ? FinishReason::kStop : FinishReason::kLength;
    choices[i].prompt_tokens = 2;
    choices[i].cached_tokens = i == 2 ? 1 : 0;
  }
  json j = completion_response(r, "cmpl-1", choices, 1700000042, m);
  EXPECT_EQ(j["object"], "text_completion");
  // The request's time, not the model's (`m.created`, the server's start, is /v1/models').
  EXPECT_EQ(j["created"], 1700000042);
  EXPECT_NE(j["created"], m.created);
  ASSERT_EQ(j["choices"].size(), 4u);
  EXPECT_EQ(j["choices"][3]["index"], 3);
  EXPECT_EQ(j["choices"][2]["text"], "bt2");  // echo: the prompt, then the text
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  EXPECT_TRUE(j["choices"][0]["logprobs"].is_null());
  // Prompt tokens once per prompt, completion tokens of every choice.
  EXPECT_EQ(j["usage"]["prompt_tokens"], 4);
  EXPECT_EQ(j["usage"]["completion_tokens"], 10);
  EXPECT_EQ(j["usage"]["total_tokens"], 14);
  EXPECT_EQ(j["usage"]["prompt_tokens_details"]["cached_tokens"], 1);

  ApiRequest c;
  ASSERT_FALSE(parse({{"messages", {{{"role", "user"}, {"content", "Hi"}}}}}, c, true));
  json first = stream_chunk(c, "chatcmpl-1", 0, "He", {}, "", true, 5, m);
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(first["choices"][0]["delta"]["content"], "He");
  EXPECT_TRUE(first["choices"][0]["finish_reason"].is_null());
  json last = stream_chunk(c, "chatcmpl-1", 0, "", {}, "length", false, 5, m);
  EXPECT_FALSE(last["choices"][0]["delta"].contains("role"));
  EXPECT_EQ(last["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(sse_event(first.dump()), "data: " + first.dump() + "\n\n");
  EXPECT_EQ(sse_event("[DONE]"), "data: [DONE]\n\n");
  json models = models_response(m);
  EXPECT_EQ(models["data"].size(), 2u);
  EXPECT_EQ(models["data"][1]["id"], "alias");
  EXPECT_EQ(models["data"][0]["max_model_len"], 64);
  // Logprobs, chat shape: token, logprob, bytes, top_logprobs.
  ApiRequest lp;
  ASSERT_FALSE(parse({{"messages", {{{"role", "user"}, {"content", "Hi"}}}},
                      {"logprobs", true},
                      {"top_logprobs", 1}},
                     lp, true));
  TokenLogprobs t;
  t.token = tokenizer_->encode("Hello", false)[0];
  t.logprob = -0.5f;
  t.top = {{t.token, -0.5f}};
  json with = stream_chunk(lp, "x", 0, "Hello", {t}, "", false, 5, m);
  json entry = with["choices"][0]["logprobs"]["content"][0];
  EXPECT_EQ(entry["token"], "Hello");
  EXPECT_EQ(entry["bytes"], json({72, 101, 108, 108, 111}));
  EXPECT_FLOAT_EQ(entry["top_logprobs"][0]["logprob"].get<float>(), -0.5f);
}

TEST(MetricsTest, PrometheusTextIsWellFormed) {
  Metrics m;
  m.ttft.observe(0.003);
  m.ttft.observe(0.2);
  m.ttft.observe(9999);  // past the last bound: +Inf only
  m.finished["stop"] = 2;
  EngineStats s;
  s.running = 3;
  s.waiting = 1;
  s.kv_cache_usage = 0.25;
  s.prefix_cache_queries = 100;
  s.prefix_cache_hits = 40;
  const std::string text = prometheus(m, s, "tiny");
  std::istringstream lines(text);
  uint64_t last_bucket = 0;
  bool saw_inf = false;
  for (std::string line; std::getline(lines, line);) {
    ASSERT_FALSE(line.empty());
    if (line[0] == '#') {
      EXPECT_TRUE(line.rfind("# HELP ", 0) == 0 || line.rfind("# TYPE ", 0) == 0) << line;
      continue;
    }
    // name{labels} value
    const size_t space = line.rfind(' ');
    ASSERT_NE(space, std::string::npos) << line;
    EXPECT_NO_THROW((void)std::stod(line.substr(space + 1))) << line;
    if (line.rfind("vllm:time_to_first_token_seconds_bucket", 0) == 0) {
      const uint64_t v = std::stoull(line.substr(space + 1));
      EXPECT_GE(v, last_bucket) << "buckets are cumulative: " << line;
      last_bucket = v;
      if (line.find("le=\"+Inf\"") != std::string::npos) {
        saw_inf = true;
        EXPECT_EQ(v, 3u);
      }
    }
  }
  EXPECT_TRUE(saw_inf);
  EXPECT_NE(text.find("vllm:num_requests_running{model_name=\"tiny\"} 3\n"), std::string::npos);
  EXPECT_NE(text.find("vllm:kv_cache_usage_perc{model_name=\"tiny\"} 0.25\n"), std::string::npos);
  EXPECT_NE(text.find("vllm:prefix_cache_hits_total{model_name=\"tiny\"} 40\n"), std::string::npos);
  EXPECT_NE(text.find("# TYPE vllm:time_to_first_token_seconds histogram"), std::string::npos);
  EXPECT_NE(text.find("vllm:time_to_first_token_seconds_count{model_name=\"tiny\"} 3\n"),
            std::string::npos);
  EXPECT_NE(text.find("vllm:request_success_total{finished_reason=\"stop\",model_name=\"tiny\"} 2"),
            std::string::npos);
}

}  // namespace
}  // namespace tessera::server
