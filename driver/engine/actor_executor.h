// Runs engine steps on an actor over Cap'n Proto RPC.
#pragma once

#include <string>

#include "driver/client.h"
#include "driver/engine/engine.h"

namespace tessera {

struct LoadOptions {
  std::string model_dir;
  std::string dtype = "auto";
  uint32_t kv_blocks = 0;  // 0: enough for one sequence of max_model_len
  uint32_t block_size = 16;
  uint32_t max_model_len = 0;
  bool return_logits = false;
  std::string device = "auto";  // auto | cuda | cpu
  float gpu_memory_utilization = 0.9f;
  bool enforce_eager = false;
  uint32_t max_num_seqs = 256;
  uint32_t max_num_batched_tokens = 0;  // 0: the actor's default
};

struct LoadedModel {
  std::string architecture;
  uint32_t vocab_size = 0;
  uint32_t num_layers = 0;
  uint32_t kv_blocks = 0;
  uint32_t block_size = 0;
  uint32_t max_model_len = 0;
  uint64_t weight_bytes = 0;
  std::string backend;
  std::string dtype;
  std::string device_name;
  uint64_t kv_cache_bytes = 0;
  uint32_t max_num_seqs = 0;
  uint32_t max_num_batched_tokens = 0;
};

class ActorExecutor final : public StepExecutor {
 public:
  // `lease` (may be null) is the lease that spawned actor `actor_id`: when a call fails because
  // the actor went away, the error says how it died (its daemon's report to the lease).
  ActorExecutor(EventLoop& loop, ActorHandle& actor, LeaseHandle* lease = nullptr,
                std::string actor_id = "")
      : loop_(loop), actor_(actor), lease_(lease), actor_id_(std::move(actor_id)) {}

  // Loads the model on the actor (bounded by a generous timeout: big checkpoints take time).
  Expected<LoadedModel> load(const LoadOptions& options);
  Expected<StepResult> execute(const StepBatch& batch) override;
  // Logits of the sampled rows of the last step, when loaded with return_logits.
  const std::vector<float>& last_logits() const { return last_logits_; }
  // Where the last step's time went, in microseconds: the whole call as the driver saw it, the
  // actor's execute, and of that the forward pass on the GPU (0 on the cpu backend).
  struct StepTimes {
    uint32_t call_us = 0, actor_us = 0, gpu_us = 0;
  };
  const StepTimes& last_times() const { return last_times_; }

 private:
  // `failed`, or how the actor died when that is why the call failed.
  Status explain(Status failed);

  EventLoop& loop_;
  ActorHandle& actor_;
  LeaseHandle* lease_;
  std::string actor_id_;
  std::vector<float> last_logits_;
  StepTimes last_times_;
};

}  // namespace tessera
