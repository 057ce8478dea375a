// The cuda backend of ModelRunner: CudaModel for the forward pass, GpuSampler for the tokens,
// per-request seeds and token histories on the host.
#include <spdlog/spdlog.h>

#include <chrono>
#include <random>

#include "actors/model/cuda_model.h"
#include "actors/model/model_runner.h"

namespace tessera {

namespace {

class CudaRunner final : public ModelRunner {
 public:
  static Expected<std::unique_ptr<ModelRunner>> load(const RunnerLoadSpec& spec) {
    TESSERA_ASSIGN_OR_RETURN(ModelConfig config, load_model_config(spec.model_dir));
    TESSERA_ASSIGN_OR_RETURN(DType dtype, resolve_dtype(spec.dtype, config.torch_dtype, true));
    TESSERA_ASSIGN_OR_RETURN(int64_t max_len, resolve_max_model_len(spec.max_model_len, config));
    TESSERA_ASSIGN_OR_RETURN(auto checkpoint, Checkpoint::open(spec.model_dir));
    TESSERA_ASSIGN_OR_RETURN(ModelWeights weights, bind_weights(*checkpoint, config));
    CudaModelOptions o;
    o.dtype = dtype;
    o.max_model_len = max_len;
    o.block_size = spec.block_size;
    o.max_num_seqs = spec.max_num_seqs;
    o.max_num_batched_tokens = resolve_max_num_batched_tokens(spec.max_num_batched_tokens, max_len);
    o.gpu_memory_utilization = spec.gpu_memory_utilization;
    o.kv_blocks = spec.kv_blocks;
    o.enforce_eager = spec.enforce_eager;
    auto t0 = std::chrono::steady_clock::now();
    TESSERA_ASSIGN_OR_RETURN(auto model, CudaModel::create(config, weights, o));
    auto runner = std::unique_ptr<CudaRunner>(new CudaRunner());
    runner->model_ = std::move(model);
    runner->return_logits_ = spec.return_logits;
    RunnerInfo& i = runner->info_;
    i.backend = "cuda";
    i.dtype = dtype;
    i.kv_blocks = runner->model_->kv_blocks();
    i.block_size = o.block_size;
    i.max_model_len = max_len;
    i.max_num_seqs = o.max_num_seqs;
    i.max_num_batched_tokens = o.max_num_batched_tokens;
    i.weight_bytes = runner->model_->memory().weights;
    i.kv_cache_bytes = runner->model_->memory().kv_cache;
    i.device_name = runner->model_->memory().device_name;
    spdlog::info("loaded {} from {} on {} in {:.1f} s: {} layers, {} ({}), max-model-len {}",
                 architecture_name(config.arch), spec.model_dir, i.device_name,
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
                 config.num_layers, dtype_name(dtype), o.enforce_eager ? "eager" : "CUDA graphs",
                 max_len);
    return std::unique_ptr<ModelRunner>(std::move(runner));
  }

  Expected<std::vector<RunnerOutput>> execute(const std::vector<RunnerSeq>& seqs,
                                              const std::vector<uint64_t>& finished,
                                              std::vector<float>* logits) override {
    for (uint64_t id : finished) requests_.erase(id);
    for (const auto& s : seqs) {
      if (!s.first) {
        TESSERA_RETURN_IF_ERROR(require_request_state(s, requests_.count(s.request_id) > 0));
        continue;
      }
      TESSERA_RETURN_IF_ERROR(s.sampling.validate());
      Request r;
      r.params = s.sampling;
      r.seed = s.sampling.seed ? *s.sampling.seed : seed_source_();
      r.prompt = s.prompt;
      requests_[s.request_id] = std::move(r);
    }
    if (seqs.empty()) return std::vector<RunnerOutput>{};
    const std::vector<ForwardSeq> batch = forward_batch(seqs);
    int64_t rows = 0;
    cudaEventRecord(ev_[0], model_->stream());
    TESSERA_ASSIGN_OR_RETURN(float* dev_logits, model_->forward(batch, &rows));
    cudaEventRecord(ev_[1], model_->stream());
    const int64_t vocab = model_->config().vocab_size;
    if (return_logits_ && logits != nullptr && rows > 0) {
      const size_t before = logits->size();
      logits->resize(before + static_cast<size_t>(rows * vocab));
      TESSERA_CUDA_RETURN_IF_ERROR(
          cudaMemcpyAsync(logits->data() + before, dev_logits, sizeof(float) * rows * vocab,
                          cudaMemcpyDeviceToHost, model_->stream()),
          "copying logits to the host");
      TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(model_->stream()), "copying logits");
    }
    std::vector<cuda::SampleRow> sample_rows;
    std::vector<Request*> owners;
    for (const auto& s : seqs) {
      if (!s.sample) continue;
      Request& r = requests_.at(s.request_id);
      sample_rows.push_back(
          {r.params, r.seed, static_cast<uint64_t>(r.output.size()), r.prompt, r.output});
      owners.push_back(&r);
    }
    std::vector<cpu::SampleResult> results;
    if (sample_rows.empty()) {
      TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(model_->stream()), "running the step");
    } else {
      TESSERA_ASSIGN_OR_RETURN(results, model_->sampler().sample(dev_logits, sample_rows));
    }
    float gpu_ms = 0;  // both events are complete: the stream was synchronised
    if (cudaEventElapsedTime(&gpu_ms, ev_[0], ev_[1]) == cudaSuccess) {
      last_gpu_micros_ = static_cast<uint32_t>(gpu_ms * 1000.0f);
    }
    std::vector<RunnerOutput> out;
    size_t k = 0;
    for (const auto& s : seqs) {
      if (!s.sample) continue;
      owners[k]->output.push_back(results[k].token);
      out.push_back({s.request_id, std::move(results[k])});
      ++k;
    }
    return out;
  }

  ~CudaRunner() override {
    for (cudaEvent_t e : ev_) {
      if (e != nullptr) cudaEventDestroy(e);
    }
  }

  const ModelConfig& config() const override { return model_->config(); }
  const RunnerInfo& info() const override { return info_; }
  size_t live_requests() const override { return requests_.size(); }
  uint32_t last_gpu_micros() const override { return last_gpu_micros_; }

 private:
  CudaRunner() : seed_source_(std::random_device{}()) {
    for (cudaEvent_t& e : ev_) cudaEventCreate(&e);
  }

  struct Request {
    cpu::SamplingParams params;
    uint64_t seed = 0;
    std::vector<int32_t> prompt;
    std::vector<int32_t> output;
  };
  std::unique_ptr<CudaModel> model_;
  bool return_logits_ = false;
  RunnerInfo info_;
  std::map<uint64_t, Request> requests_;
  std::mt19937_64 seed_source_;
  uint32_t last_gpu_micros_ = 0;
  cudaEvent_t ev_[2] = {nullptr, nullptr};  // around the forward pass (its GPU time)
};

}  // namespace

bool cuda_device_visible() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return count > 0;
}

Expected<std::unique_ptr<ModelRunner>> load_cuda_runner(const RunnerLoadSpec& spec) {
  return CudaRunner::load(spec);
}

}  // namespace tessera
