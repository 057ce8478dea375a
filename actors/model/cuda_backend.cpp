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
    for (Launch& l : launches_) {
      for (cudaEvent_t& e : l.ev) cudaEventCreate(&e);
    }
  }
  ~CudaBackend() override {
    for (Launch& l : launches_) {
      for (cudaEvent_t e : l.ev) {
        if (e != nullptr) cudaEventDestroy(e);
      }
    }
  }

  int64_t fit_kv_blocks() const override { return model_->memory().fit_blocks; }
  ExpertLoad expert_load() const override { return model_->expert_load(); }
  Status init_cache(int64_t blocks) override { return model_->init_cache(blocks); }

  Status launch(const StepBatch& batch, bool want_logits) override {
    const std::span<const SampleRequest> rows = batch.rows();
    if (outstanding_ >= 2) return failed_precondition("two steps are running on this GPU already");
    Launch& l = launches_[(oldest_ + outstanding_) % 2];
    l.ticket = {};
    l.logits.clear();
    cudaStream_t stream = model_->stream();
    int64_t computed = 0;
    cudaEventRecord(l.ev[0], stream);
    TESSERA_ASSIGN_OR_RETURN(float* dev_logits,
                             model_->forward(batch.seqs(), &computed, batch.fills()));
    cudaEventRecord(l.ev[1], stream);
    cuda::GpuSampler* sampler = model_->sampler();
    if (sampler != nullptr && !rows.empty()) {
      const int64_t vocab = model_->config().vocab_size;
      if (want_logits && computed > 0) {  // before the sampler, which overwrites them
        l.logits.resize(static_cast<size_t>(computed * vocab));
        TESSERA_CUDA_RETURN_IF_ERROR(
            cudaMemcpyAsync(l.logits.data(), dev_logits, sizeof(float) * computed * vocab,
                            cudaMemcpyDeviceToHost, stream),
            "copying logits to the host");
        TESSERA_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), "copying logits to the host");
      }
      std::vector<cuda::SampleRow> sample_rows;
      sample_rows.reserve(rows.size());
      for (const SampleRequest& r : rows) {
        const RequestState& s = *r.state;
        sample_rows.push_back(
            {s.sampling, s.seed, static_cast<uint64_t>(s.output().size()), s.prompt(), s.output()});
      }
      TESSERA_ASSIGN_OR_RETURN(l.ticket, sampler->enqueue(dev_logits, sample_rows));
    }
    cudaEventRecord(l.ev[2], stream);
    ++outstanding_;
    return Status::ok();
  }

  Expected<std::vector<SampleResult>> collect(std::vector<float>* logits) override {
    if (outstanding_ == 0) return failed_precondition("no step is running on this GPU");
    Launch& l = launches_[oldest_];
    oldest_ = (oldest_ + 1) % 2;
    --outstanding_;
    const cudaError_t waited = cudaEventSynchronize(l.ev[2]);
    // The sampler's call is finished either way (it would stay outstanding otherwise).
    Expected<std::vector<SampleResult>> results = std::vector<SampleResult>{};
    if (l.ticket.slot >= 0) results = model_->sampler()->finish(l.ticket);
    TESSERA_CUDA_RETURN_IF_ERROR(waited, "running the step");
    if (!results) return results.status();
    if (logits != nullptr) logits->insert(logits->end(), l.logits.begin(), l.logits.end());
    float gpu_ms = 0;  // both events are complete
    if (cudaEventElapsedTime(&gpu_ms, l.ev[0], l.ev[1]) == cudaSuccess) {
      last_gpu_micros_ = static_cast<uint32_t>(gpu_ms * 1000.0f);
    }
    return std::move(*results);
  }

  bool collect_ready() const override {
    return outstanding_ == 0 || cudaEventQuery(launches_[oldest_].ev[2]) != cudaErrorNotReady;
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
    i.block_size = model_->engine().block_size;
    i.max_model_len = model_->engine().max_model_len;
    i.weight_bytes = m.weights;
    i.kv_cache_bytes = m.kv_cache;
    i.backend = "cuda";
    i.dtype = dtype_name(model_->dtype());
    i.kv_cache_dtype = kv_cache_storage_name(model_->engine().kv_cache_dtype, model_->dtype());
    i.device_name = m.device_name;
    // The spec is resolved, so this agrees with the checkpoint (CudaModel::create checked it).
    const Expected<QuantConfig> quant =
        resolve_quantization(model_->engine().quantization, c.quant);
    i.quantization = quant ? quant->describe() : quant_method_name(model_->engine().quantization);
    return i;
  }

  uint32_t last_gpu_micros() const override { return last_gpu_micros_; }

 private:
  // A launch not collected: events around its forward pass (its GPU time) and after its last
  // work, its sampling call, its logits when asked for. Two, used in turn.
  struct Launch {
    cudaEvent_t ev[3] = {nullptr, nullptr, nullptr};
    cuda::SampleTicket ticket;
    std::vector<float> logits;
  };
  std::unique_ptr<CudaModel> model_;
  uint32_t last_gpu_micros_ = 0;
  Launch launches_[2];
  int oldest_ = 0;
  int outstanding_ = 0;
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

Expected<std::unique_ptr<Backend>> load_cuda_backend(const LoadSpec& spec,
                                                     const ModelConfig& config,
                                                     const LayerPlan& plan,
                                                     const ModelWeights& weights,
                                                     StageComms comms) {
  TESSERA_ASSIGN_OR_RETURN(auto model, CudaModel::create(config, plan, weights, std::move(comms),
                                                         spec.engine, spec.gpu_shares));
  return std::unique_ptr<Backend>(new CudaBackend(std::move(model)));
}

}  // namespace tessera
