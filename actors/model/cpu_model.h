// The cpu backend: one rank's stage of the forward pass (actors/model/layer_loop.h) in fp32 from
// bf16/fp16/fp32 weights, over a paged KV cache of this rank's KV heads, with its tensor- and
// pipeline-parallel peers reached through Communicators (TCP). The reference the cuda backend is
// tested against, and what CI runs every parallel layout on.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "actors/model/backend.h"
#include "actors/model/weights.h"
#include "common/checkpoint/layer_plan.h"
#include "common/checkpoint/model_config.h"
#include "common/kv_cache_dtype.h"
#include "kernels/cpu/cpu_context.h"
#include "kernels/cpu/moe.h"
#include "kernels/cpu/paged_kv_cache.h"
#include "kernels/cpu/rope.h"
#include "kernels/cpu/sampling.h"

namespace tessera {

class CpuModel final : public Backend {
 public:
  // `kv_blocks` blocks of engine.block_size tokens fit (the cache is allocated by init_cache).
  // `engine` is resolved (check_resolved).
  static Expected<std::unique_ptr<CpuModel>> create(const ModelConfig& config, LayerPlan plan,
                                                    ModelWeights weights, StageComms comms,
                                                    int64_t kv_blocks, const EngineSpec& engine,
                                                    int threads = 0);

  // The forward pass alone: the logits [rows, vocab] of the sequences with want_logits, in
  // order, on the last stage (every tensor-parallel rank of it); empty on the other stages.
  // Errors fail the whole batch.
  Expected<std::vector<float>> forward(std::span<const ForwardSeq> batch);

  int64_t fit_kv_blocks() const override { return fit_blocks_; }
  Status init_cache(int64_t blocks) override;
  // Runs the step at once (the samples wait in the launch for collect()).
  Status launch(const StepBatch& batch, bool want_logits) override;
  Expected<std::vector<SampleResult>> collect(std::vector<float>* logits) override;
  void forget(uint64_t request_id) override { samplers_.erase(request_id); }
  ModelInfo info() const override;
  uint64_t progress() const override { return ctx_.ticks(); }
  // Tensor-parallel MoE: tp rank 0 counts (every rank routes every token alike); expert
  // parallel: each rank its share of the tokens.
  ExpertLoad expert_load() const override;

  const ModelConfig& config() const { return config_; }
  const LayerPlan& plan() const { return plan_; }
  const ModelWeights& weights() const { return weights_; }

 private:
  CpuModel(const ModelConfig& config, LayerPlan plan, ModelWeights weights, StageComms comms,
           const EngineSpec& engine, int threads);
  class Step;  // one forward pass's buffers and ops (layer_loop.h's Ops)
  struct Launch {
    std::vector<SampleResult> samples;
    std::vector<float> logits;
  };
  // Each quantized linear layer's `weight` becomes its dequantized F32 [out, in] (online FP8:
  // quantized first): the CPU backend computes what the checkpoint's format means, exactly.
  Status dequantize_linears();
  // The MoE layers' views for cpu::moe (the experts as bound).
  void bind_moe();
  Expected<std::vector<SampleResult>> run_step(std::span<const ForwardSeq> batch,
                                               std::span<const SampleRequest> rows,
                                               std::vector<float>* logits);

  ModelConfig config_;
  LayerPlan plan_;
  ModelWeights weights_;
  StageComms comms_;
  cpu::CpuContext ctx_;
  std::unique_ptr<cpu::PagedKvCache> cache_;
  std::unique_ptr<cpu::RopeTable> rope_;
  std::unique_ptr<cpu::RopeTable> rope_local_;  // Gemma 3's local layers' (null: rope_ for all)
  int64_t fit_blocks_ = 0;
  EngineSpec engine_;                          // resolved
  QuantConfig quant_;                          // the linear layers' (resolved with engine_)
  std::vector<cpu::MoeLayer> moe_;             // per stage layer; router.data null: dense
  // Adds one MoE layer's routings (stage layer `layer`) to load_.
  void count_routings(int64_t layer, const std::vector<int64_t>& routed);
  mutable std::mutex load_mu_;                 // expert_load() reads while steps count
  ExpertLoad load_;                            // this rank's MoE layers' routings
  std::map<uint64_t, cpu::Sampler> samplers_;  // the sampling rank's, per request
  std::vector<int32_t> last_tokens_;           // sampled by the last launch (async scheduling)
  std::deque<Launch> launched_;                // not collected yet, oldest first
  // lm_head's vocabulary-sized buffers, kept from step to step (Step::logits): a fresh
  // allocation of each per step was a step's costliest part for small models (and, at this
  // size, fresh pages every time under ASan).
  std::vector<float> lm_rows_, lm_shard_, lm_mine_, lm_gathered_;
};

}  // namespace tessera
