#include "driver/generate.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "common/checkpoint/model_config.h"
#include "common/tokenizer/tokenizer.h"
#include "driver/client.h"
#include "driver/engine/actor_executor.h"
#include "driver/engine/engine.h"
#include "driver/local_node.h"

namespace tessera {

namespace {

class TokenizerDetokenizer final : public Detokenizer {
 public:
  explicit TokenizerDetokenizer(const Tokenizer& t) : t_(t) {}
  std::string decode(const std::vector<int32_t>& ids, bool skip_special) const override {
    return t_.decode(ids, skip_special);
  }

 private:
  const Tokenizer& t_;
};

Status run(const GenerateOptions& o) {
  GenerationDefaults defaults;
  TESSERA_ASSIGN_OR_RETURN(ModelConfig config, load_model_config(o.model, &defaults));
  TESSERA_ASSIGN_OR_RETURN(auto tokenizer, Tokenizer::load(o.model));
  TESSERA_RETURN_IF_ERROR(validate_sampling(o.sampling));
  std::vector<int32_t> prompt = tokenizer->encode(o.prompt, /*add_special_tokens=*/true);

  std::unique_ptr<LocalNode> local;
  std::string address = o.address;
  if (address.empty()) {
    TESSERA_ASSIGN_OR_RETURN(local, LocalNode::start());
    address = local->address();
  }
  EventLoop loop;
  TESSERA_ASSIGN_OR_RETURN(auto cluster, ClusterClient::connect(loop, address));
  NodeHandle node = cluster->head_node();
  TESSERA_ASSIGN_OR_RETURN(auto lease, node.open_lease("tessera generate"));
  TESSERA_ASSIGN_OR_RETURN(ActorView actor, lease->spawn({.name = "generate-cpu"}));
  TESSERA_ASSIGN_OR_RETURN(auto handle, ActorHandle::connect(loop, actor.address));
  ActorExecutor executor(loop, *handle);

  uint32_t max_len =
      o.max_model_len
          ? o.max_model_len
          : static_cast<uint32_t>(std::min<int64_t>(config.max_position_embeddings, 8192));
  if (o.max_model_len > config.max_position_embeddings) {
    return invalid_argument("--max-model-len " + std::to_string(o.max_model_len) +
                            " exceeds the model's max_position_embeddings (" +
                            std::to_string(config.max_position_embeddings) + ")");
  }
  LoadOptions load;
  load.model_dir = o.model;
  load.dtype = o.dtype;
  load.max_model_len = max_len;
  auto t0 = std::chrono::steady_clock::now();
  TESSERA_ASSIGN_OR_RETURN(LoadedModel model, executor.load(load));
  auto t_loaded = std::chrono::steady_clock::now();

  EngineConfig ec;
  ec.num_blocks = model.kv_blocks;
  ec.block_size = model.block_size;
  ec.scheduler.max_model_len = model.max_model_len;
  ec.scheduler.max_num_batched_tokens = std::max<uint32_t>(model.max_model_len, 2048);
  ec.vocab_size = model.vocab_size;
  for (int64_t id : config.eos_token_ids) ec.eos_token_ids.push_back(static_cast<int32_t>(id));
  TokenizerDetokenizer detok(*tokenizer);
  LlmEngine engine(ec, executor, detok);
  TESSERA_ASSIGN_OR_RETURN(uint64_t id, engine.add_request(prompt, o.sampling));
  (void)id;

  std::string text;
  std::vector<int32_t> output;
  std::vector<TokenLogprobs> logprobs;
  std::string finish;
  std::optional<std::chrono::steady_clock::time_point> first_token;
  while (engine.has_unfinished()) {
    TESSERA_ASSIGN_OR_RETURN(auto outs, engine.step());
    for (auto& out : outs) {
      if (!first_token) first_token = std::chrono::steady_clock::now();
      text += out.delta;
      output.insert(output.end(), out.new_tokens.begin(), out.new_tokens.end());
      logprobs.insert(logprobs.end(), out.new_logprobs.begin(), out.new_logprobs.end());
      if (!o.json) {
        std::cout << out.delta << std::flush;
      }
      if (out.finished) finish = out.finish_reason;
    }
  }
  auto t_end = std::chrono::steady_clock::now();
  if (finish.rfind("error: ", 0) == 0) return internal_error(finish.substr(7));
  if (o.json) {
    nlohmann::json lp = nlohmann::json::array();
    for (const auto& l : logprobs) {
      nlohmann::json top = nlohmann::json::array();
      for (const auto& [t, p] : l.top) top.push_back({t, p});
      lp.push_back({{"token", l.token}, {"logprob", l.logprob}, {"top", top}});
    }
    nlohmann::json j = {{"prompt_ids", prompt},
                        {"output_ids", output},
                        {"text", text},
                        {"finish_reason", finish},
                        {"logprobs", lp}};
    std::cout << j.dump() << "\n";
  } else {
    std::cout << std::endl;  // before the summary on stderr
  }
  using ms = std::chrono::duration<double, std::milli>;
  double decode_ms = first_token ? ms(t_end - *first_token).count() : 0.0;
  std::fprintf(
      stderr,
      "[%s, %s backend] prompt %zu tokens, output %zu tokens (%s); load %.0f ms, "
      "first token %.0f ms, %.1f tok/s after it\n",
      model.architecture.c_str(), model.backend.c_str(), prompt.size(), output.size(),
      finish.c_str(), ms(t_loaded - t0).count(),
      first_token ? ms(*first_token - t_loaded).count() : 0.0,
      output.size() > 1 && decode_ms > 0 ? (output.size() - 1) / (decode_ms / 1000.0) : 0.0);
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
