// Test helpers for running a model on the CPU backend, whole or split: each rank a thread of
// this process, joined by the tcp collectives the actors use (actors/comm/rank_comms.h), every
// rank running every step as in the actors.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "actors/comm/rank_comms.h"
#include "actors/model/model_runner.h"

namespace tessera {

inline constexpr int64_t kBlocks = 64;  // KV blocks each test rank allocates

// One rank's spec on the cpu backend (the fp32 oracle, on any machine), resolved as the
// driver resolves it.
inline LoadSpec cpu_spec(const std::string& model_dir, int64_t max_model_len,
                         const ParallelConfig& parallel = {},
                         QuantMethod quantization = QuantMethod::kAuto) {
  EngineSpec engine;
  engine.model = model_dir;
  engine.quantization = quantization;
  engine.max_model_len = max_model_len;
  engine.return_logits = true;
  engine.enable_expert_parallel = parallel.expert_parallel;
  auto spec = load_spec_for_rank(engine, parallel, Device::kCpu);
  EXPECT_TRUE(spec) << spec.status().to_string();
  if (!spec) return LoadSpec{};
  spec->threads = 1;
  return *spec;
}

// Runs `fn(rank)` on every rank at once (the collectives block until all ranks take part).
template <typename Fn>
inline void on_every_rank(int world, Fn fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) threads.emplace_back([&fn, r] { fn(r); });
  for (auto& t : threads) t.join();
}

// The ranks of one tp x pp group of CPU runners, as an actor group would hold them.
class RankGroup {
 public:
  // `expert_parallel`: --enable-expert-parallel (whole experts per tensor-parallel rank).
  static Expected<std::unique_ptr<RankGroup>> load(const std::string& model_dir, int tp, int pp,
                                                   QuantMethod quantization = QuantMethod::kAuto,
                                                   bool expert_parallel = false) {
    auto g = std::unique_ptr<RankGroup>(new RankGroup);
    const int world = tp * pp;
    g->comms_.resize(world);
    g->runners_.resize(world);
    std::vector<Status> status(world, Status::ok());
    std::vector<RankInfo> ranks(world);
    if (world > 1) {
      for (int r = 0; r < world; ++r) {
        auto c = comm::RankComms::prepare("tcp", "127.0.0.1", 0, r, world);
        if (!c) return c.status();
        ranks[r].rank = r;
        ranks[r].actor_id = "rank-" + std::to_string(r);
        ranks[r].node_id = "n-test";
        ranks[r].address = (*c)->address();
        g->comms_[r] = std::move(*c);
      }
    }
    on_every_rank(world, [&](int r) {
      ParallelConfig parallel;
      parallel.tp_size = tp;
      parallel.pp_size = pp;
      parallel.tp_rank = r % tp;
      parallel.pp_rank = r / tp;
      parallel.expert_parallel = expert_parallel;
      LoadSpec spec = cpu_spec(model_dir, 256, parallel, quantization);
      StageComms stage;
      if (world > 1) {
        spec.comm.backend = CommBackend::kTcp;
        spec.comm.ranks = ranks;
        spec.comm.secret = "parity-test-secret-parity-test-secret";
        spec.engine.nccl_init_timeout_s = 30;
        status[r] = g->comms_[r]->join(spec);
        if (!status[r].is_ok()) return;
        stage = g->comms_[r]->stage();
      }
      auto runner = ModelRunner::load(spec, stage);
      if (!runner) {
        status[r] = runner.status();
        return;
      }
      status[r] = (*runner)->init_cache(std::min<int64_t>(kBlocks, (*runner)->info().kv_blocks));
      g->runners_[r] = std::move(*runner);
    });
    for (const Status& s : status) {
      if (!s.is_ok()) return s;
    }
    return g;
  }

  // Runs the step on every rank; the sampling rank's output.
  Expected<StepOutput> execute(const StepInput& step) {
    const int world = static_cast<int>(runners_.size());
    std::vector<Expected<StepOutput>> out(world, internal_error("not run"));
    on_every_rank(world, [&](int r) { out[r] = runners_[r]->execute(step); });
    int sampler = -1;
    for (int r = 0; r < world; ++r) {
      if (!out[r]) return out[r].status();
      if (runners_[r]->samples()) sampler = r;
    }
    if (sampler < 0) return internal_error("no rank samples");
    for (int r = 0; r < world; ++r) {
      if (r != sampler && !out[r]->outputs.empty()) {
        return internal_error("rank " + std::to_string(r) + " sampled but is not the sampler");
      }
    }
    return std::move(out[sampler]);
  }

  const ModelRunner& rank(int r) const { return *runners_[r]; }
  int64_t vocab() const { return runners_.front()->config().vocab_size; }

 private:
  RankGroup() = default;
  std::vector<std::unique_ptr<comm::RankComms>> comms_;
  std::vector<std::unique_ptr<ModelRunner>> runners_;
};

inline StepInput seq_step(uint64_t request, std::vector<int32_t> tokens, int64_t start, bool first,
                   int64_t prompt_len, std::vector<uint32_t> new_blocks) {
  SeqStep s;
  s.request_id = request;
  s.tokens = std::move(tokens);
  s.start_position = start;
  s.new_blocks = std::move(new_blocks);
  s.sample = true;
  s.first = first;
  s.prompt_len = prompt_len;
  s.sampling.temperature = 0.0f;  // greedy
  StepInput step;
  step.seqs.push_back(std::move(s));
  return step;
}

inline StepInput finish(uint64_t request) {
  StepInput step;
  step.finished.push_back(request);
  return step;
}

}  // namespace tessera
