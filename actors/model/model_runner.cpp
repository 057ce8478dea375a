#include "actors/model/model_runner.h"

#include <spdlog/spdlog.h>

#include <chrono>

#include "actors/model/cpu_model.h"
#include "actors/model/weights.h"

namespace tessera {

ModelRunner::ModelRunner(ModelConfig config, LayerPlan plan, RequestLimits limits)
    : config_(std::move(config)), plan_(std::move(plan)), requests_(limits) {}

Expected<std::unique_ptr<ModelRunner>> ModelRunner::load(const LoadSpec& spec, StageComms comms) {
  if (spec.device != "auto" && spec.device != "cuda" && spec.device != "cpu") {
    return invalid_argument("--device '" + spec.device + "' is not one of auto, cuda, cpu");
  }
  bool gpu = spec.device == "cuda";
#ifdef TESSERA_WITH_CUDA
  if (spec.device == "auto") gpu = cuda_device_visible();
#else
  if (gpu) {
    return failed_precondition(
        "--device cuda: this tessera-actor was built without CUDA (configure with "
        "-DTESSERA_CUDA=ON on a machine with nvcc)");
  }
#endif
  if (spec.block_size < 1 || spec.max_num_seqs < 1) {
    return invalid_argument("block size and max-num-seqs must be positive");
  }
  const auto t0 = std::chrono::steady_clock::now();
  TESSERA_ASSIGN_OR_RETURN(ModelConfig config, load_model_config(spec.model_dir));
  TESSERA_ASSIGN_OR_RETURN(DType dtype, resolve_dtype(spec.dtype, config.torch_dtype, gpu));
  TESSERA_ASSIGN_OR_RETURN(KvCacheDtype kv_dtype, parse_kv_cache_dtype(spec.kv_cache_dtype));
  TESSERA_ASSIGN_OR_RETURN(LayerPlan plan, LayerPlan::make(config, spec.parallel));
  TESSERA_ASSIGN_OR_RETURN(int64_t max_len, resolve_max_model_len(spec.max_model_len, config));
  const int64_t max_tokens = resolve_max_num_batched_tokens(spec.max_num_batched_tokens, max_len);
  TESSERA_ASSIGN_OR_RETURN(auto checkpoint, Checkpoint::open(spec.model_dir));
  TESSERA_ASSIGN_OR_RETURN(ModelWeights weights, bind_weights(*checkpoint, config, plan));

  RequestLimits limits;
  limits.vocab_size = config.vocab_size;
  limits.block_size = spec.block_size;
  limits.max_model_len = max_len;
  limits.max_num_seqs = spec.max_num_seqs;
  limits.max_num_batched_tokens = max_tokens;
  std::unique_ptr<ModelRunner> r(new ModelRunner(config, plan, limits));
  r->return_logits_ = spec.return_logits;
  if (gpu) {
#ifdef TESSERA_WITH_CUDA
    CudaLoad load{&r->config_, &r->plan_, &weights, comms, dtype, kv_dtype, max_len, max_tokens};
    TESSERA_ASSIGN_OR_RETURN(r->backend_, load_cuda_backend(spec, load));
#endif
  } else {
    (void)dtype;  // checked above; the cpu backend computes in fp32 whatever the checkpoint holds
    // The cpu backend (the oracle, and the backend of tests without a GPU) holds one sequence
    // of max-model-len plus a block; the driver's scheduler preempts past that.
    const int64_t blocks = (max_len + spec.block_size - 1) / spec.block_size + 1;
    TESSERA_ASSIGN_OR_RETURN(auto model,
                             CpuModel::create(config, plan, std::move(weights), comms, blocks,
                                              spec.block_size, max_len, spec.threads, kv_dtype));
    r->backend_ = std::move(model);
  }
  r->checkpoint_ = std::move(checkpoint);
  const ModelInfo info = r->backend_->info();
  spdlog::info(
      "loaded {} from {} in {:.1f} s: rank {} of {} (tp {}/{}, pp {}/{}), layers {}-{} of {}, "
      "{:.1f} MiB of weights on the {} backend ({}, KV cache {}), {} KV blocks fit",
      architecture_name(config.arch), spec.model_dir,
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
      plan.parallel.rank(), plan.parallel.world_size(), plan.parallel.tp_rank,
      plan.parallel.tp_size, plan.parallel.pp_rank, plan.parallel.pp_size, plan.layer_begin,
      plan.layer_end - 1, config.num_layers, static_cast<double>(info.weight_bytes) / (1 << 20),
      info.backend, info.dtype, info.kv_cache_dtype, info.kv_blocks);
  return r;
}

Status ModelRunner::init_cache(int64_t blocks) {
  TESSERA_RETURN_IF_ERROR(backend_->init_cache(blocks));
  requests_.set_num_blocks(blocks);
  cache_ready_ = true;
  return Status::ok();
}

ModelInfo ModelRunner::info() const {
  ModelInfo i = backend_->info();
  i.max_num_seqs = requests_.limits().max_num_seqs;
  i.max_num_batched_tokens = requests_.limits().max_num_batched_tokens;
  return i;
}

Expected<StepOutput> ModelRunner::execute(const StepInput& step) {
  if (!cache_ready_) {
    return failed_precondition("the KV cache is not allocated yet: call initCache after loadModel");
  }
  const auto t0 = std::chrono::steady_clock::now();
  TESSERA_RETURN_IF_ERROR(requests_.apply(step));
  for (uint64_t id : requests_.forgotten()) backend_->forget(id);
  StepOutput out;
  out.step_id = step.step_id;
  if (!step.seqs.empty()) {
    const std::vector<ForwardSeq> batch = requests_.batch(step);
    std::vector<SampleRequest> rows;
    for (const SeqStep& s : step.seqs) {
      if (s.sample) rows.push_back({s.request_id, &requests_.at(s.request_id)});
    }
    TESSERA_ASSIGN_OR_RETURN(std::vector<SampleResult> samples,
                             backend_->step(batch, rows, return_logits_ ? &out.logits : nullptr));
    for (size_t i = 0; i < samples.size(); ++i) {
      requests_.record_sample(rows[i].request_id, samples[i].token);
      out.outputs.push_back({rows[i].request_id, std::move(samples[i])});
    }
  }
  out.actor_micros = static_cast<uint32_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0)
          .count());
  out.gpu_micros = backend_->last_gpu_micros();
  return out;
}

}  // namespace tessera
