// Generation through a ModelRunner the two ways the actor runs steps: one at a time (each
// step's samples fed back as tokens), and launching each decode step before the step before is
// collected, its tokens taken as kSampledToken (async scheduling; the backend fills them in).
// Shared by the CPU runner tests and the CUDA model tests: both ways must give the same tokens.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "actors/model/model_runner.h"
#include "common/step.h"

namespace tessera::testing {

// The first step of each prompt (the whole prompt, blocks for `steps` more tokens) and a step
// of one token per request after it. Blocks are numbered from 0 in order.
inline StepInput prompt_step(const std::vector<std::vector<int32_t>>& prompts, int steps,
                             const std::vector<SamplingParams>& params, uint64_t first_id,
                             int64_t block_size = 16) {
  StepInput in;
  in.step_id = 1;
  uint32_t next_block = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    SeqStep s;
    s.request_id = first_id + i;
    s.tokens = prompts[i];
    s.first = true;
    s.sample = true;
    s.prompt_len = static_cast<int64_t>(prompts[i].size());
    s.sampling = params[i];
    const int64_t tokens = s.prompt_len + steps;
    for (int64_t b = 0; b * block_size < tokens; ++b) s.new_blocks.push_back(next_block++);
    in.seqs.push_back(std::move(s));
  }
  return in;
}

inline StepInput decode_step(const std::vector<std::vector<int32_t>>& prompts, uint64_t first_id,
                             int step, const std::vector<int32_t>& tokens) {
  StepInput in;
  in.step_id = static_cast<uint64_t>(step) + 1;
  for (size_t i = 0; i < prompts.size(); ++i) {
    SeqStep s;
    s.request_id = first_id + i;
    s.tokens = {tokens[i]};
    s.start_position = static_cast<int64_t>(prompts[i].size()) + step - 1;
    s.sample = true;
    in.seqs.push_back(std::move(s));
  }
  return in;
}

// `steps` tokens per prompt; ahead: every decode step launched before the one before is
// collected. The requests are forgotten at the end.
inline std::vector<std::vector<int32_t>> generate_steps(
    ModelRunner& r, const std::vector<std::vector<int32_t>>& prompts, int steps,
    const std::vector<SamplingParams>& params, bool ahead, uint64_t first_id = 1000) {
  std::vector<std::vector<int32_t>> out(prompts.size());
  auto take = [&](Expected<StepOutput> res) {
    EXPECT_TRUE(res) << res.status().to_string();
    if (!res) return false;
    EXPECT_EQ(res->outputs.size(), prompts.size());
    if (res->outputs.size() != prompts.size()) return false;
    for (size_t i = 0; i < prompts.size(); ++i) out[i].push_back(res->outputs[i].sample.token);
    return true;
  };
  r.submit(prompt_step(prompts, steps, params, first_id));
  for (int step = 1; step < steps; ++step) {
    if (ahead) {
      const StepInput next =
          decode_step(prompts, first_id, step, std::vector<int32_t>(prompts.size(), kSampledToken));
      EXPECT_TRUE(r.can_launch_ahead(next));
      r.submit(next);
      if (!take(r.collect())) return out;
    } else {
      if (!take(r.collect())) return out;
      std::vector<int32_t> last;
      for (const auto& o : out) last.push_back(o.back());
      r.submit(decode_step(prompts, first_id, step, last));
    }
  }
  take(r.collect());
  StepInput done;
  done.step_id = static_cast<uint64_t>(steps) + 1;
  for (size_t i = 0; i < prompts.size(); ++i) done.finished.push_back(first_id + i);
  auto forgot = r.execute(done);
  EXPECT_TRUE(forgot) << forgot.status().to_string();
  return out;
}

}  // namespace tessera::testing
