#include "driver/server/response_writer.h"

#include <spdlog/fmt/fmt.h>

#include <algorithm>

#include "driver/server/tool_parser.h"

namespace tessera::server {

using nlohmann::json;

namespace {

// What every format shares: the request it answers and, by default, the JSON body of
// completion_response and a stream that ends with the error event alone.
class WriterBase : public ResponseWriter {
 public:
  WriterBase(const ApiRequest& req, std::string id, int64_t created, const ServedModel& model)
      : req_(req),
        id_(std::move(id)),
        created_(created),
        model_(model),
        started_(req.requests.size() * static_cast<size_t>(req.n), false) {}

  const char* stream_content_type() const override { return nullptr; }
  std::string on_output(size_t, const RequestOutput&, const ChoiceResult&) override { return ""; }
  std::vector<std::string> stream_end(const std::vector<ChoiceResult>&,
                                      const std::optional<ApiError>& error) override {
    std::vector<std::string> chunks;
    if (error) chunks.push_back(sse_event(error_body(*error)));
    return chunks;
  }
  json body(const std::vector<ChoiceResult>& results) const override {
    return completion_response(req_, id_, results, created_, model_);
  }

 protected:
  // The prompt of choice `index` as text.
  const std::string& prompt_text(size_t index) const {
    return req_.prompt_texts[index / static_cast<size_t>(req_.n)];
  }

  const ApiRequest& req_;
  const std::string id_;
  const int64_t created_;
  const ServedModel& model_;
  std::vector<bool> started_;  // each choice has streamed its first output
};

// Not streamed: completion_response once every choice finished.
class JsonWriter final : public WriterBase {
 public:
  using WriterBase::WriterBase;
};

// Server-sent events: a chunk per output, then usage (stream_options.include_usage) and
// "data: [DONE]".
class SseWriter : public WriterBase {
 public:
  using WriterBase::WriterBase;
  const char* stream_content_type() const override { return "text/event-stream; charset=utf-8"; }
  std::vector<std::string> stream_end(const std::vector<ChoiceResult>& results,
                                      const std::optional<ApiError>& error) override {
    std::vector<std::string> chunks = WriterBase::stream_end(results, error);
    if (req_.include_usage) {
      chunks.push_back(sse_event(usage_chunk(req_, id_, results, created_).dump()));
    }
    chunks.push_back(sse_event("[DONE]"));
    return chunks;
  }

 protected:
  // The text chunk of `out`: its delta (after the prompt on the first with echo), its logprobs,
  // its finish reason when it is the last; a chat choice's first chunk carries the role even
  // when empty.
  std::string text_chunk(size_t index, const RequestOutput& out) {
    const bool first = !started_[index];
    started_[index] = true;
    if (out.delta.empty() && out.new_logprobs.empty() && !out.finished && !(req_.chat && first)) {
      return "";
    }
    std::string text = out.delta;
    if (req_.echo && first) text = prompt_text(index) + text;
    const std::string finish = out.finished ? api_finish_reason(out.finish_reason) : "";
    json chunk = stream_chunk(req_, id_, static_cast<int>(index), text, out.new_logprobs, finish,
                              req_.chat && first, created_, model_);
    return sse_event(chunk.dump());
  }
};

// text_completion chunks.
class SseCompletionWriter final : public SseWriter {
 public:
  using SseWriter::SseWriter;
  std::string on_output(size_t index, const RequestOutput& out, const ChoiceResult&) override {
    return text_chunk(index, out);
  }
};

// chat.completion.chunk chunks; with tool parsing (ApiRequest::parse_tools) the content as it
// comes and each tool call once it is complete, and finish_reason "tool_calls" after a call.
class SseChatWriter final : public SseWriter {
 public:
  SseChatWriter(const ApiRequest& req, std::string id, int64_t created, const ServedModel& model)
      : SseWriter(req, std::move(id), created, model),
        tools_(req.parse_tools ? started_.size() : 0) {}

  std::string on_output(size_t index, const RequestOutput& out, const ChoiceResult&) override {
    return req_.parse_tools ? tool_chunks(index, out) : text_chunk(index, out);
  }

 private:
  std::string tool_chunks(size_t index, const RequestOutput& out) {
    const bool first = !started_[index];
    started_[index] = true;
    const int i = static_cast<int>(index);
    HermesStream& tools = tools_[index];
    HermesStream::Delta d = tools.push(out.delta);
    if (out.finished) d.content += tools.finish().content;
    const int before = tools.calls() - static_cast<int>(d.calls.size());
    std::string data;
    if (!d.content.empty() || first) {
      data += sse_event(
          stream_chunk(req_, id_, i, d.content, out.new_logprobs, "", first, created_, model_)
              .dump());
    }
    if (!d.calls.empty()) {
      data += sse_event(tool_call_chunk(req_, id_, i, d.calls, before, created_).dump());
    }
    if (out.finished) {
      const std::string reason =
          tools.calls() > 0 ? std::string("tool_calls") : api_finish_reason(out.finish_reason);
      data += sse_event(stream_chunk(req_, id_, i, "", {}, reason, false, created_, model_).dump());
    }
    return data;
  }

  std::vector<HermesStream> tools_;  // by choice
};

// vLLM's legacy /generate: {"text": [prompt + output, ...]}; streamed, one such object (the
// choice's text so far) per output, each followed by a NUL byte, and no trailer.
class GenerateWriter final : public WriterBase {
 public:
  using WriterBase::WriterBase;
  const char* stream_content_type() const override { return "application/json"; }
  std::string on_output(size_t index, const RequestOutput&, const ChoiceResult& result) override {
    json text = json::array({prompt_text(index) + result.text});
    json object = {{"text", text}};
    return object.dump() + std::string(1, '\0');
  }
  json body(const std::vector<ChoiceResult>& results) const override {
    json texts = json::array();
    for (size_t i = 0; i < results.size(); ++i) texts.push_back(prompt_text(i) + results[i].text);
    return {{"text", texts}};
  }
};

}  // namespace

ChoiceResults::ChoiceResults(const ApiRequest& req, Clock::time_point arrived)
    : req_(req),
      arrived_(arrived),
      results_(req.requests.size() * static_cast<size_t>(req.n)),
      done_(results_.size(), false),
      last_(results_.size(), arrived) {}

void ChoiceResults::add(size_t index, const RequestOutput& out, Metrics& metrics) {
  ChoiceResult& r = results_[index];
  const auto now = Clock::now();
  if (!out.new_tokens.empty()) {
    if (r.tokens.empty()) {
      metrics.ttft.observe(std::chrono::duration<double>(now - arrived_).count());
    } else {
      const double gap = std::chrono::duration<double>(now - last_[index]).count() /
                         static_cast<double>(out.new_tokens.size());
      for (size_t k = 0; k < out.new_tokens.size(); ++k) metrics.itl.observe(gap);
    }
    last_[index] = now;
  }
  r.text += out.delta;
  r.tokens.insert(r.tokens.end(), out.new_tokens.begin(), out.new_tokens.end());
  r.logprobs.insert(r.logprobs.end(), out.new_logprobs.begin(), out.new_logprobs.end());
  r.prompt_tokens = out.prompt_tokens ? out.prompt_tokens : r.prompt_tokens;
  r.cached_tokens = std::max(r.cached_tokens, out.cached_tokens);
  if (!out.finished) return;
  done_[index] = true;
  finished_++;
  r.finish_reason = out.finish_reason;
  r.prompt_tokens = req_.requests[index / static_cast<size_t>(req_.n)].prompt().size();
  if (out.finish_reason == FinishReason::kError) {
    error_ = out.error.message();
  } else {
    metrics.finished[api_finish_reason(out.finish_reason)]++;
  }
  metrics.e2e.observe(std::chrono::duration<double>(now - arrived_).count());
}

std::string ChoiceResults::summary() const {
  size_t prompt_tokens = 0, completion_tokens = 0;
  for (size_t i = 0; i < results_.size(); ++i) {
    completion_tokens += results_[i].tokens.size();
    if (i % static_cast<size_t>(req_.n) == 0) prompt_tokens += results_[i].prompt_tokens;
  }
  return fmt::format("{} choice(s), {} prompt + {} completion tokens in {:.3f} s{}",
                     results_.size(), prompt_tokens, completion_tokens,
                     std::chrono::duration<double>(Clock::now() - arrived_).count(),
                     error_.empty() ? "" : "; failed: " + error_);
}

std::unique_ptr<ResponseWriter> make_response_writer(const ApiRequest& req, bool legacy,
                                                     std::string id, int64_t created,
                                                     const ServedModel& model) {
  if (legacy) return std::make_unique<GenerateWriter>(req, std::move(id), created, model);
  if (!req.stream) return std::make_unique<JsonWriter>(req, std::move(id), created, model);
  if (req.chat) return std::make_unique<SseChatWriter>(req, std::move(id), created, model);
  return std::make_unique<SseCompletionWriter>(req, std::move(id), created, model);
}

}  // namespace tessera::server
