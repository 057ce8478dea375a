#include "driver/generate.h"

#include <chrono>
#include <cstdio>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>

#include "common/tokenizer/tokenizer.h"
#include "driver/engine/engine.h"
#include "driver/model_session.h"

namespace tessera {

namespace {

struct PromptResult {
  std::vector<int32_t> prompt;
  std::string text;
  std::vector<int32_t> output;
  std::vector<TokenLogprobs> logprobs;
  std::string finish;
  std::optional<std::chrono::steady_clock::time_point> first_token;
};

Status run(const GenerateOptions& o) {
  if (o.prompts.empty()) return invalid_argument("give at least one --prompt");
  // Everything that can be checked is checked before a node starts or a model loads.
  TESSERA_RETURN_IF_ERROR(validate(o.engine));
  TESSERA_ASSIGN_OR_RETURN(ModelConfig config, load_model_config(o.engine.model));
  TESSERA_RETURN_IF_ERROR(o.sampling.validate(config.vocab_size));
  auto t0 = std::chrono::steady_clock::now();
  TESSERA_ASSIGN_OR_RETURN(auto session, ModelSession::open(o.engine, "tessera generate"));
  auto t_loaded = std::chrono::steady_clock::now();
  LlmEngine& engine = session->engine();
  std::vector<PromptResult> results(o.prompts.size());
  std::map<uint64_t, size_t> index;
  for (size_t i = 0; i < o.prompts.size(); ++i) {
    results[i].prompt = session->tokenizer().encode(o.prompts[i], /*add_special_tokens=*/true);
    TESSERA_ASSIGN_OR_RETURN(uint64_t id, engine.add_request(results[i].prompt, o.sampling));
    index[id] = i;
  }
  const bool stream = o.prompts.size() == 1 && !o.json;
  while (engine.has_unfinished()) {
    TESSERA_ASSIGN_OR_RETURN(auto outs, engine.step());
    for (auto& out : outs) {
      PromptResult& r = results[index.at(out.request_id)];
      if (!r.first_token) r.first_token = std::chrono::steady_clock::now();
      r.text += out.delta;
      r.output.insert(r.output.end(), out.new_tokens.begin(), out.new_tokens.end());
      r.logprobs.insert(r.logprobs.end(), out.new_logprobs.begin(), out.new_logprobs.end());
      if (stream) std::cout << out.delta << std::flush;
      if (out.finished) r.finish = out.finish_reason;
    }
  }
  auto t_end = std::chrono::steady_clock::now();
  for (const auto& r : results) {
    if (r.finish.rfind("error: ", 0) == 0) return internal_error(r.finish.substr(7));
  }
  if (o.json) {
    for (const auto& r : results) {
      nlohmann::json lp = nlohmann::json::array();
      for (const auto& l : r.logprobs) {
        nlohmann::json top = nlohmann::json::array();
        for (const auto& [t, p] : l.top) top.push_back({t, p});
        lp.push_back({{"token", l.token}, {"logprob", l.logprob}, {"top", top}});
      }
      nlohmann::json j = {{"prompt_ids", r.prompt},
                          {"output_ids", r.output},
                          {"text", r.text},
                          {"finish_reason", r.finish},
                          {"logprobs", lp}};
      std::cout << j.dump() << "\n";
    }
  } else if (stream) {
    std::cout << std::endl;  // before the summary on stderr
  } else {
    for (size_t i = 0; i < results.size(); ++i) {
      std::cout << "[" << i << "] " << o.prompts[i] << results[i].text << "\n";
    }
  }
  using ms = std::chrono::duration<double, std::milli>;
  size_t prompt_tokens = 0, output_tokens = 0;
  std::optional<std::chrono::steady_clock::time_point> first;
  for (const auto& r : results) {
    prompt_tokens += r.prompt.size();
    output_tokens += r.output.size();
    if (r.first_token && (!first || *r.first_token < *first)) first = r.first_token;
  }
  const ModelInfo& m = session->model();
  if (session->plan().plan.world > 1 || !session->plan().choice.empty()) {
    std::fputs(plan_summary(session->plan()).c_str(), stderr);
  }
  double decode_ms = first ? ms(t_end - *first).count() : 0.0;
  std::fprintf(stderr,
               "[%s, %s backend%s%s, %s] %zu prompt(s), %zu prompt tokens, %zu output tokens (%s); "
               "load %.0f ms, first token %.0f ms, %.1f tok/s after it\n",
               m.architecture.c_str(), m.backend.c_str(), m.device_name.empty() ? "" : " on ",
               m.device_name.c_str(), m.dtype.c_str(), results.size(), prompt_tokens, output_tokens,
               results.size() == 1 ? results[0].finish.c_str() : "batched",
               ms(t_loaded - t0).count(), first ? ms(*first - t_loaded).count() : 0.0,
               output_tokens > results.size() && decode_ms > 0
                   ? (output_tokens - results.size()) / (decode_ms / 1000.0)
                   : 0.0);
  return Status::ok();
}

}  // namespace

int generate_command(const GenerateOptions& options) {
  Status st = run(options);
  if (!st) {
    std::cerr << "tessera generate: " << st.message() << "\n";
    return 1;
  }
  return 0;
}

}  // namespace tessera
