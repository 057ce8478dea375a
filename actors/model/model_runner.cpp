#include "actors/model/model_runner.h"

#include <spdlog/spdlog.h>

namespace tessera {

Expected<DType> resolve_dtype(const std::string& name, DType checkpoint_dtype, bool gpu) {
  if (name == "auto") {
    if (gpu && checkpoint_dtype == DType::kF32) return DType::kBF16;
    return checkpoint_dtype;
  }
  if (name == "bfloat16") return DType::kBF16;
  if (name == "float16" || name == "half") return DType::kF16;
  if (name == "float32" || name == "float") {
    if (gpu) {
      return invalid_argument(
          "--dtype float32 is supported on the cpu backend only: use --dtype bfloat16 or "
          "float16 on the GPU, or --device cpu");
    }
    return DType::kF32;
  }
  return invalid_argument("--dtype '" + name +
                          "' is not one of auto, bfloat16, float16 (half), float32 (float)");
}

Expected<int64_t> resolve_max_model_len(int64_t requested, const ModelConfig& config) {
  if (requested > config.max_position_embeddings) {
    return invalid_argument("--max-model-len " + std::to_string(requested) +
                            " exceeds the model's max_position_embeddings (" +
                            std::to_string(config.max_position_embeddings) + ")");
  }
  if (requested > 0) return requested;
  return std::min<int64_t>(config.max_position_embeddings, 8192);
}

Status require_request_state(const RunnerSeq& seq, bool known) {
  if (seq.first || known) return Status::ok();
  return failed_precondition("request " + std::to_string(seq.request_id) +
                             " has no state on this actor (its first step never came): the "
                             "driver must send the prompt with first = true");
}

std::vector<ForwardSeq> forward_batch(const std::vector<RunnerSeq>& seqs) {
  std::vector<ForwardSeq> batch;
  batch.reserve(seqs.size());
  for (const auto& s : seqs) batch.push_back({s.tokens, s.start_position, s.block_table, s.sample});
  return batch;
}

int64_t resolve_max_num_batched_tokens(int64_t requested, int64_t max_model_len) {
  if (requested > 0) return requested;
  return std::min<int64_t>(std::max<int64_t>(max_model_len, 2048), 16384);
}

namespace {

// The CPU backend: fp32 reference math, the per-request cpu::Sampler.
class CpuRunner final : public ModelRunner {
 public:
  static Expected<std::unique_ptr<ModelRunner>> load(const RunnerLoadSpec& spec) {
    TESSERA_ASSIGN_OR_RETURN(ModelConfig config, load_model_config(spec.model_dir));
    TESSERA_RETURN_IF_ERROR(resolve_dtype(spec.dtype, config.torch_dtype, false).status());
    TESSERA_ASSIGN_OR_RETURN(auto checkpoint, Checkpoint::open(spec.model_dir));
    TESSERA_ASSIGN_OR_RETURN(ModelWeights weights, bind_weights(*checkpoint, config));
    TESSERA_ASSIGN_OR_RETURN(int64_t max_len, resolve_max_model_len(spec.max_model_len, config));
    int64_t blocks =
        spec.kv_blocks > 0 ? spec.kv_blocks : (max_len + spec.block_size - 1) / spec.block_size + 1;
    TESSERA_ASSIGN_OR_RETURN(auto model, CpuModel::create(config, std::move(weights), blocks,
                                                          spec.block_size, max_len, spec.threads));
    auto runner = std::unique_ptr<CpuRunner>(new CpuRunner());
    runner->checkpoint_ = std::move(checkpoint);
    runner->model_ = std::move(model);
    runner->return_logits_ = spec.return_logits;
    RunnerInfo& i = runner->info_;
    i.backend = "cpu";
    i.dtype = DType::kF32;
    i.kv_blocks = blocks;
    i.block_size = spec.block_size;
    i.max_model_len = max_len;
    i.max_num_seqs = spec.max_num_seqs;
    i.max_num_batched_tokens = resolve_max_num_batched_tokens(spec.max_num_batched_tokens, max_len);
    i.weight_bytes = runner->model_->weights().bytes;
    spdlog::info(
        "loaded {} from {}: {} layers, {:.1f} MiB of weights, KV cache {} blocks x {} "
        "tokens (fp32 math on the CPU backend, checkpoint dtype {})",
        architecture_name(config.arch), spec.model_dir, config.num_layers,
        static_cast<double>(i.weight_bytes) / (1 << 20), blocks, spec.block_size,
        dtype_name(config.torch_dtype));
    return std::unique_ptr<ModelRunner>(std::move(runner));
  }

  Expected<std::vector<RunnerOutput>> execute(const std::vector<RunnerSeq>& seqs,
                                              const std::vector<uint64_t>& finished,
                                              std::vector<float>* logits) override {
    for (uint64_t id : finished) requests_.erase(id);
    // New requests get their sampler before any compute, so bad parameters fail fast.
    for (const auto& s : seqs) {
      if (!s.first) {
        TESSERA_RETURN_IF_ERROR(require_request_state(s, requests_.count(s.request_id) > 0));
        continue;
      }
      TESSERA_ASSIGN_OR_RETURN(cpu::Sampler sampler, cpu::Sampler::create(s.sampling));
      requests_.erase(s.request_id);
      requests_.emplace(s.request_id, Request{std::move(sampler), s.prompt, {}});
    }
    TESSERA_ASSIGN_OR_RETURN(std::vector<float> rows, model_->forward(forward_batch(seqs)));
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
    if (return_logits_ && logits != nullptr) {
      logits->insert(logits->end(), rows.begin(), rows.end());
    }
    return out;
  }

  const ModelConfig& config() const override { return model_->config(); }
  const RunnerInfo& info() const override { return info_; }
  size_t live_requests() const override { return requests_.size(); }

 private:
  CpuRunner() = default;

  struct Request {
    cpu::Sampler sampler;
    std::vector<int32_t> prompt;
    std::vector<int32_t> output;
  };
  std::unique_ptr<Checkpoint> checkpoint_;  // the weights' storage (mmap); outlives model_
  std::unique_ptr<CpuModel> model_;
  bool return_logits_ = false;
  RunnerInfo info_;
  std::map<uint64_t, Request> requests_;
};

}  // namespace

Expected<std::unique_ptr<ModelRunner>> ModelRunner::load(const RunnerLoadSpec& spec) {
  if (spec.device != "auto" && spec.device != "cuda" && spec.device != "cpu") {
    return invalid_argument("--device '" + spec.device + "' is not one of auto, cuda, cpu");
  }
#ifdef TESSERA_WITH_CUDA
  if (spec.device == "cuda" || (spec.device == "auto" && cuda_device_visible())) {
    return load_cuda_runner(spec);
  }
#else
  if (spec.device == "cuda") {
    return failed_precondition(
        "--device cuda: this tessera-actor was built without CUDA (configure with "
        "-DTESSERA_CUDA=ON on a machine with nvcc)");
  }
#endif
  return CpuRunner::load(spec);
}

}  // namespace tessera
