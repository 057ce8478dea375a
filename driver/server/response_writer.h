// The answer to one completion request, in the format its endpoint and `stream` ask for: one
// JSON body at the end (/v1/completions, /v1/chat/completions), an SSE stream of text-completion
// or chat chunks (with Hermes tool calls streamed as they complete), or vLLM's legacy /generate
// (a {"text": [...]} body, or NUL-separated JSON objects when streamed). Writers make the bytes;
// the HTTP server (serve.cpp) sends them, each string one HTTP chunk. No I/O here. Beside them,
// the results the choices build up as their outputs arrive.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "driver/engine/engine.h"
#include "driver/server/metrics.h"
#include "driver/server/openai_api.h"

namespace tessera::server {

class ResponseWriter {
 public:
  virtual ~ResponseWriter() = default;

  // The Content-Type of the answer when it streams (ApiRequest::stream: chunked, written as
  // outputs arrive); nullptr for a format that never streams.
  virtual const char* stream_content_type() const = 0;
  // Streaming: the bytes to send for `out`, an output of choice `index`, whose result so far
  // (this output included) is `result`; "" when there is nothing to send yet. Called for each
  // output in order until a choice fails.
  virtual std::string on_output(size_t index, const RequestOutput& out,
                                const ChoiceResult& result) = 0;
  // Streaming: the chunks that end the stream once every choice finished: the error event when
  // a choice failed (`error`), then the format's trailer (usage, "data: [DONE]").
  virtual std::vector<std::string> stream_end(const std::vector<ChoiceResult>& results,
                                              const std::optional<ApiError>& error) = 0;
  // Not streaming: the 200 answer's JSON body once every choice finished (none failed).
  virtual nlohmann::json body(const std::vector<ChoiceResult>& results) const = 0;
};

// A request's choices as their outputs arrive (one thread): each choice's result so far, which
// have finished, why one failed, and what they add to the server's latency and finish metrics.
class ChoiceResults {
 public:
  using Clock = std::chrono::steady_clock;
  // `req` is borrowed; the request arrived at `arrived`.
  ChoiceResults(const ApiRequest& req, Clock::time_point arrived);

  // Adds `out`, an output of choice `index`, observing time to first token, inter-token latency
  // and, when it is the last, the end-to-end latency and finish reason in `metrics`.
  void add(size_t index, const RequestOutput& out, Metrics& metrics);
  size_t size() const { return results_.size(); }
  bool finished(size_t index) const { return done_[index]; }
  bool all_finished() const { return finished_ == results_.size(); }
  const std::vector<ChoiceResult>& results() const { return results_; }
  // Why a choice failed (the last to fail); "" while none did.
  const std::string& error() const { return error_; }
  // For the log: "2 choice(s), 5 prompt + 32 completion tokens in 0.120 s[; failed: why]".
  std::string summary() const;

 private:
  const ApiRequest& req_;
  Clock::time_point arrived_;
  std::vector<ChoiceResult> results_;
  std::vector<bool> done_;
  std::vector<Clock::time_point> last_;  // each choice's last token, for inter-token latency
  size_t finished_ = 0;
  std::string error_;
};

// The writer for `req` (borrowed, with `model`: both must outlive it), answered as `id` created
// at unix second `created`. `legacy`: the /generate endpoint.
std::unique_ptr<ResponseWriter> make_response_writer(const ApiRequest& req, bool legacy,
                                                     std::string id, int64_t created,
                                                     const ServedModel& model);

}  // namespace tessera::server
