#include "driver/llm.h"

#include <map>
#include <string>
#include <utility>

namespace tessera {

Expected<std::unique_ptr<LLM>> LLM::open(const EngineArgs& args, const std::string& owner) {
  std::unique_ptr<LLM> llm(new LLM());
  TESSERA_ASSIGN_OR_RETURN(llm->session_, ModelSession::open(args, owner));
  return llm;
}

Expected<std::vector<GenerationResult>> LLM::generate(
    const std::vector<std::string>& prompts, const SamplingParams& params,
    const std::function<void(size_t, const RequestOutput&)>& on_output) {
  std::vector<std::vector<int32_t>> ids;
  ids.reserve(prompts.size());
  for (const auto& p : prompts) {
    ids.push_back(session_->tokenizer().encode(p, /*add_special_tokens=*/true));
  }
  return generate(ids, params, on_output);
}

Expected<std::vector<GenerationResult>> LLM::generate(
    const std::vector<std::vector<int32_t>>& prompt_token_ids, const SamplingParams& params,
    const std::function<void(size_t, const RequestOutput&)>& on_output) {
  std::vector<Request> requests;
  requests.reserve(prompt_token_ids.size());
  for (size_t i = 0; i < prompt_token_ids.size(); ++i) {
    auto r = Request::make(prompt_token_ids[i], params, session_->model());
    if (!r) return r.status().with_context("prompt " + std::to_string(i));
    requests.push_back(std::move(*r));
  }
  return generate(std::move(requests), on_output);
}

Expected<std::vector<GenerationResult>> LLM::generate(
    std::vector<Request> requests,
    const std::function<void(size_t, const RequestOutput&)>& on_output) {
  LlmEngine& engine = session_->engine();
  std::vector<GenerationResult> results(requests.size());
  std::map<uint64_t, size_t> index;
  std::vector<Status> errors(requests.size());  // of the requests that failed
  const auto now = std::chrono::steady_clock::now();
  for (size_t i = 0; i < requests.size(); ++i) {
    results[i].prompt_token_ids = requests[i].prompt();
    results[i].arrival = now;
    auto id = engine.add_request(std::move(requests[i]));
    if (!id) {
      // Nothing of this call may stay queued.
      for (const auto& [queued, _] : index) engine.abort_request(queued);
      return id.status().with_context("prompt " + std::to_string(i));
    }
    index[*id] = i;
  }
  while (engine.has_unfinished()) {
    if (Status stop = interrupt_ ? interrupt_() : Status::ok(); !stop) {
      for (const auto& [queued, _] : index) engine.abort_request(queued);
      return stop;
    }
    TESSERA_ASSIGN_OR_RETURN(auto outs, engine.step());
    for (auto& out : outs) {
      auto it = index.find(out.request_id);
      if (it == index.end()) continue;
      GenerationResult& r = results[it->second];
      if (!r.first_token && !out.new_tokens.empty())
        r.first_token = std::chrono::steady_clock::now();
      r.text += out.delta;
      r.token_ids.insert(r.token_ids.end(), out.new_tokens.begin(), out.new_tokens.end());
      r.logprobs.insert(r.logprobs.end(), out.new_logprobs.begin(), out.new_logprobs.end());
      r.finished = std::chrono::steady_clock::now();
      r.cached_tokens = out.cached_tokens;
      if (out.finished) {
        r.finish_reason = out.finish_reason;
        r.stop_reason = out.stop_reason;
      }
      if (out.finish_reason == FinishReason::kError) errors[it->second] = out.error;
      if (on_output) on_output(it->second, out);
    }
  }
  for (const Status& e : errors) {
    if (!e) return internal_error(e.message());
  }
  return results;
}

}  // namespace tessera
