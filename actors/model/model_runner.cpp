#include "actors/model/model_runner.h"

#include <spdlog/spdlog.h>

namespace tessera {

Expected<std::unique_ptr<ModelRunner>> ModelRunner::load(const RunnerLoadSpec& spec) {
  static const char* kDtypes[] = {"auto", "bfloat16", "float16", "half", "float32", "float"};
  bool known = false;
  for (const char* d : kDtypes) known |= spec.dtype == d;
  if (!known) {
    return invalid_argument("--dtype '" + spec.dtype +
                            "' is not one of auto, bfloat16, float16 (half), float32 (float)");
  }
  TESSERA_ASSIGN_OR_RETURN(ModelConfig config, load_model_config(spec.model_dir));
  TESSERA_ASSIGN_OR_RETURN(auto checkpoint, Checkpoint::open(spec.model_dir));
  TESSERA_ASSIGN_OR_RETURN(ModelWeights weights, bind_weights(*checkpoint, config));
  int64_t max_len = spec.max_model_len > 0
                        ? spec.max_model_len
                        : std::min<int64_t>(config.max_position_embeddings, 8192);
  int64_t blocks =
      spec.kv_blocks > 0 ? spec.kv_blocks : (max_len + spec.block_size - 1) / spec.block_size + 1;
  TESSERA_ASSIGN_OR_RETURN(auto model, CpuModel::create(config, std::move(weights), blocks,
                                                        spec.block_size, max_len, spec.threads));
  auto runner = std::make_unique<ModelRunner>();
  runner->checkpoint_ = std::move(checkpoint);
  runner->model_ = std::move(model);
  runner->return_logits_ = spec.return_logits;
  spdlog::info(
      "loaded {} from {}: {} layers, {:.1f} MiB of weights, KV cache {} blocks x {} "
      "tokens (fp32 math on the CPU backend, checkpoint dtype {})",
      architecture_name(config.arch), spec.model_dir, config.num_layers,
      static_cast<double>(runner->weight_bytes()) / (1 << 20), blocks, spec.block_size,
      dtype_name(config.torch_dtype));
  return runner;
}

Expected<std::vector<RunnerOutput>> ModelRunner::execute(const std::vector<RunnerSeq>& seqs,
                                                         const std::vector<uint64_t>& finished,
                                                         std::vector<float>* logits) {
  for (uint64_t id : finished) requests_.erase(id);
  // New requests get their sampler before any compute, so bad parameters fail fast.
  for (const auto& s : seqs) {
    if (!s.first) {
      if (!requests_.count(s.request_id)) {
        return failed_precondition("request " + std::to_string(s.request_id) +
                                   " has no state on this actor (its first step never came)");
      }
      continue;
    }
    TESSERA_ASSIGN_OR_RETURN(cpu::Sampler sampler, cpu::Sampler::create(s.sampling));
    requests_.erase(s.request_id);
    requests_.emplace(s.request_id, Request{std::move(sampler), s.prompt, {}});
  }
  std::vector<ForwardSeq> batch;
  batch.reserve(seqs.size());
  for (const auto& s : seqs) {
    batch.push_back({s.tokens, s.start_position, s.block_table, s.sample});
  }
  TESSERA_ASSIGN_OR_RETURN(std::vector<float> rows, model_->forward(batch));
  const int64_t vocab = model_->config().vocab_size;
  std::vector<RunnerOutput> out;
  size_t row = 0;
  for (const auto& s : seqs) {
    if (!s.sample) continue;
    Request& r = requests_.at(s.request_id);
    const float* l = rows.data() + row * vocab;
    ++row;
    TESSERA_ASSIGN_OR_RETURN(cpu::SampleResult result,
                             r.sampler.sample(l, vocab, r.prompt, r.output));
    r.output.push_back(result.token);
    out.push_back({s.request_id, std::move(result)});
  }
  if (return_logits_ && logits != nullptr) logits->insert(logits->end(), rows.begin(), rows.end());
  return out;
}

}  // namespace tessera
