// One model served by one actor, for the driver's commands (generate, bench, later serve): the
// cluster connection (or an embedded local node), a lease, the actor (on a GPU when the node
// has one), the loaded model and an engine over it.
#pragma once

#include <memory>
#include <string>

#include "common/checkpoint/model_config.h"
#include "common/status.h"
#include "common/tokenizer/tokenizer.h"
#include "driver/client.h"
#include "driver/engine/actor_executor.h"
#include "driver/engine/engine.h"
#include "driver/local_node.h"

namespace tessera {

// vLLM's engine arguments, as far as Tessera has them.
struct EngineArgs {
  std::string model;               // Hugging Face model directory
  std::string address;             // a cluster's head; "" = start a local node for this command
  std::string cluster_token_file;  // with address: where the token is (else the environment
                                   // or this machine's temp root, see protocol/auth.h)
  std::string dtype = "auto";
  std::string device = "auto";  // auto | cuda | cpu
  uint32_t max_model_len = 0;   // 0 = min(max_position_embeddings, 8192)
  float gpu_memory_utilization = 0.9f;
  bool enforce_eager = false;
  uint32_t max_num_seqs = 256;
  uint32_t max_num_batched_tokens = 0;  // 0 = max(max_model_len, 2048), at most 16384
  bool return_logits = false;           // tests
};

// OK when the arguments make sense, before anything starts or loads; INVALID_ARGUMENT naming
// the flag otherwise.
Status validate(const EngineArgs& args);

class ModelSession {
 public:
  // Connects (or starts a local node), spawns the actor, loads the model. `detokenize` = false
  // gives the engine a detokenizer that returns no text (benchmarks).
  static Expected<std::unique_ptr<ModelSession>> open(const EngineArgs& args,
                                                      const std::string& owner,
                                                      bool detokenize = true);
  ~ModelSession();

  LlmEngine& engine() { return *engine_; }
  const LoadedModel& model() const { return model_; }
  const ModelConfig& config() const { return config_; }
  const GenerationDefaults& defaults() const { return defaults_; }
  const Tokenizer& tokenizer() const { return *tokenizer_; }
  ActorExecutor& executor() { return *executor_; }
  double load_seconds() const { return load_seconds_; }

 private:
  ModelSession() = default;

  ModelConfig config_;
  GenerationDefaults defaults_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<LocalNode> local_;
  std::unique_ptr<EventLoop> loop_;
  std::unique_ptr<ClusterClient> cluster_;
  std::unique_ptr<LeaseHandle> lease_;
  std::unique_ptr<ActorHandle> actor_;
  std::unique_ptr<ActorExecutor> executor_;
  std::unique_ptr<Detokenizer> detokenizer_;
  std::unique_ptr<LlmEngine> engine_;
  LoadedModel model_;
  double load_seconds_ = 0.0;
};

}  // namespace tessera
