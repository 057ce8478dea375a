// The cuda backend of ModelRunner: CudaModel for this rank's stage, GpuSampler for the tokens on
// the rank that samples, per-request seeds and token histories from the request table.
#include <spdlog/spdlog.h>

#include <chrono>

#include "actors/model/cuda_model.h"
#include "actors/model/model_runner.h"

namespace tessera {

namespace {

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(std::unique_ptr<CudaModel> model) : model_(std::move(model)) {
    for (cudaEvent_t& e : ev_) cudaEventCreate(&e);
  }
  ~CudaBackend() override {
    for (cudaEvent_t e : ev_) {
      if (e != nullptr) cudaEventDestroy(e);
    }
  }

  int64_t fit_kv_blocks() const override { return model_->memory().fit_blocks; }
  Status init_cache(int64_t blocks) override { return model_->init_cache(blocks); }

  Expected<std::vector<SampleResult>> step(std::span<const ForwardSeq> batch,
                                           std::span<const SampleRequest> rows,
                                           std::vector<float>* logits) override {
    std::vector<SampleResult> results;
    int64_t computed = 0;
    cudaEventRecord(ev_[0], model_->stream());
    TESSERA_ASSIGN_OR_RETURN(float* dev_logits, model_->forward(batch, &computed));
    cudaEventRecord(ev_[1], model_->stream());
    cuda::GpuSampler* sampler = model_->sampler();
    if (sampler == nullptr || rows.empty()) {
      TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(model_->stream()), "running the step");
    } else {
      const int64_t vocab = model_->config().vocab_size;
      if (logits != nullptr && computed > 0) {
        const size_t before = logits->size();
        logits->resize(before + static_cast<size_t>(computed * vocab));
        TESSERA_CUDA_RETURN_IF_ERROR(
            cudaMemcpyAsync(logits->data() + before, dev_logits, sizeof(float) * computed * vocab,
                            cudaMemcpyDeviceToHost, model_->stream()),
            "copying logits to the host");
      }
      std::vector<cuda::SampleRow> sample_rows;
      sample_rows.reserve(rows.size());
      for (const SampleRequest& r : rows) {
        const RequestState& s = *r.state;
        sample_rows.push_back(
            {s.sampling, s.seed, static_cast<uint64_t>(s.output().size()), s.prompt(), s.output()});
      }
      TESSERA_ASSIGN_OR_RETURN(results, sampler->sample(dev_logits, sample_rows));
    }
    float gpu_ms = 0;  // both events are complete: the stream was synchronised
    if (cudaEventElapsedTime(&gpu_ms, ev_[0], ev_[1]) == cudaSuccess) {
      last_gpu_micros_ = static_cast<uint32_t>(gpu_ms * 1000.0f);
    }
    return results;
  }

  ModelInfo info() const override {
    const ModelConfig& c = model_->config();
    const LayerPlan& p = model_->plan();
    const GpuMemoryReport& m = model_->memory();
    ModelInfo i;
    i.architecture = architecture_name(c.arch);
    i.vocab_size = c.vocab_size;
    i.num_layers = c.num_layers;
    i.layer_begin = p.layer_begin;
    i.layer_end = p.layer_end;
    i.kv_blocks = m.kv_blocks > 0 ? m.kv_blocks : m.fit_blocks;
    i.block_size = model_->options().block_size;
    i.max_model_len = model_->options().max_model_len;
    i.weight_bytes = m.weights;
    i.kv_cache_bytes = m.kv_cache;
    i.backend = "cuda";
    i.dtype = dtype_name(model_->options().dtype);
    i.kv_cache_dtype =
        kv_cache_storage_name(model_->options().kv_cache_dtype, model_->options().dtype);
    i.device_name = m.device_name;
    return i;
  }

  uint32_t last_gpu_micros() const override { return last_gpu_micros_; }

 private:
  std::unique_ptr<CudaModel> model_;
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

Expected<std::unique_ptr<Backend>> load_cuda_backend(const LoadSpec& spec, const CudaLoad& load) {
  CudaModelOptions o;
  o.dtype = load.dtype;
  o.max_model_len = load.max_model_len;
  o.block_size = spec.block_size;
  o.max_num_seqs = spec.max_num_seqs;
  o.max_num_batched_tokens = load.max_num_batched_tokens;
  o.gpu_memory_utilization = spec.gpu_memory_utilization;
  o.enforce_eager = spec.enforce_eager;
  o.kv_cache_dtype = load.kv_cache_dtype;
  TESSERA_ASSIGN_OR_RETURN(
      auto model, CudaModel::create(*load.config, *load.plan, *load.weights, load.comms, o));
  return std::unique_ptr<Backend>(new CudaBackend(std::move(model)));
}

}  // namespace tessera
