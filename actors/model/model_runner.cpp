#include "actors/model/model_runner.h"

#include <spdlog/spdlog.h>

#include <chrono>

#include "actors/model/cpu_model.h"
#include "actors/model/weights.h"

namespace tessera {

ModelRunner::ModelRunner(ModelConfig config, LayerPlan plan, ModelInfo limits)
    : config_(std::move(config)), plan_(std::move(plan)), requests_(std::move(limits)) {}

Expected<std::unique_ptr<ModelRunner>> ModelRunner::load(const LoadSpec& spec, StageComms comms) {
  const EngineSpec& e = spec.engine;
  TESSERA_RETURN_IF_ERROR(check_resolved(e));
  const bool gpu = e.device == Device::kCuda;
  if (!gpu && e.load_format == LoadFormat::kDummy) {
    return failed_precondition(
        "--load-format dummy runs on the CUDA backend (--device cuda); the CPU backend reads "
        "the checkpoint");
  }
#ifdef TESSERA_WITH_CUDA
  if (gpu && !cuda_device_visible()) {
    return failed_precondition("--device cuda: this actor sees no GPU (CUDA_VISIBLE_DEVICES, "
                               "or the driver placed a GPU rank on a node without one)");
  }
#else
  if (gpu) {
    return failed_precondition(
        "--device cuda: this tessera-actor was built without CUDA (configure with "
        "-DTESSERA_CUDA=ON on a machine with nvcc)");
  }
#endif
  const auto t0 = std::chrono::steady_clock::now();
  TESSERA_ASSIGN_OR_RETURN(ModelConfig config, load_model_config(e.model));
  TESSERA_ASSIGN_OR_RETURN(LayerPlan plan, LayerPlan::make(config, spec.parallel));
  // --load-format dummy: nothing is read beyond config.json (the GPU fills the weights).
  std::unique_ptr<Checkpoint> checkpoint;
  ModelWeights weights = dummy_weights(config, plan);
  if (e.load_format != LoadFormat::kDummy) {
    TESSERA_ASSIGN_OR_RETURN(checkpoint, Checkpoint::open(e.model));
    TESSERA_ASSIGN_OR_RETURN(weights, bind_weights(*checkpoint, config, plan));
  }

  // The bounds every step is checked against: what this rank will report of itself.
  ModelInfo limits;
  limits.vocab_size = config.vocab_size;
  limits.block_size = e.block_size;
  limits.max_model_len = e.max_model_len;
  limits.max_num_seqs = e.max_num_seqs;
  limits.max_num_batched_tokens = e.max_num_batched_tokens;
  std::unique_ptr<ModelRunner> r(new ModelRunner(config, plan, limits));
  r->requests_.set_samples(r->samples());
  r->return_logits_ = e.return_logits;
  if (gpu) {
#ifdef TESSERA_WITH_CUDA
    TESSERA_ASSIGN_OR_RETURN(r->backend_,
                             load_cuda_backend(spec, r->config_, r->plan_, weights, comms));
#endif
  } else {
    // The cpu backend (the oracle, and the backend of tests without a GPU) computes in fp32
    // whatever the checkpoint holds, and holds one sequence of max-model-len plus a block; the
    // driver's scheduler preempts past that.
    const int64_t blocks = (e.max_model_len + e.block_size - 1) / e.block_size + 1;
    TESSERA_ASSIGN_OR_RETURN(auto model, CpuModel::create(config, plan, std::move(weights), comms,
                                                          blocks, e, spec.threads));
    r->backend_ = std::move(model);
  }
  r->checkpoint_ = std::move(checkpoint);
  const ModelInfo info = r->backend_->info();
  spdlog::info(
      "loaded {} from {} in {:.1f} s: rank {} of {} (tp {}/{}, pp {}/{}), layers {}-{} of {}, "
      "{:.1f} MiB of weights ({}) on the {} backend ({}, KV cache {}), {} KV blocks fit",
      architecture_name(config.arch), e.model,
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
      plan.parallel.rank(), plan.parallel.world_size(), plan.parallel.tp_rank,
      plan.parallel.tp_size, plan.parallel.pp_rank, plan.parallel.pp_size, plan.layer_begin,
      plan.layer_end - 1, config.num_layers, static_cast<double>(info.weight_bytes) / (1 << 20),
      info.quantization, info.backend, info.dtype, info.kv_cache_dtype, info.kv_blocks);
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
  if (!running_.empty()) {
    return failed_precondition("steps are running on this actor: collect them first");
  }
  submit(step);
  return collect();
}

void ModelRunner::submit(const StepInput& step) {
  Running r;
  r.step_id = step.step_id;
  r.submitted = std::chrono::steady_clock::now();
  r.error = launch(step, r);
  running_.push_back(std::move(r));
}

Status ModelRunner::launch(const StepInput& step, Running& r) {
  if (!cache_ready_) {
    return failed_precondition("the KV cache is not allocated yet: call initCache after loadModel");
  }
  if (running_.size() >= 2 || (!running_.empty() && !can_launch_ahead(step))) {
    return failed_precondition("step " + std::to_string(step.step_id) +
                               " cannot start before the step running is collected");
  }
  if (plan_.parallel.pp_size > 1) {
    for (const SeqStep& s : step.seqs) {
      if (takes_sampled_token(s)) {
        return failed_precondition(
            "a step takes a sampled token (async scheduling) on a pipeline of " +
            std::to_string(plan_.parallel.pp_size) +
            " stages: the first stage never sees the last one's samples (run it with "
            "--pipeline-parallel-size 1)");
      }
    }
  }
  TESSERA_RETURN_IF_ERROR(requests_.apply(step));
  for (uint64_t id : requests_.forgotten()) backend_->forget(id);
  if (step.seqs.empty()) return Status::ok();
  // The tokens the backend takes from the samples of the launch before: the placeholders, or
  // with tensor parallelism every kSampledToken, on every rank alike (the ranks that do not
  // sample get them from the one that does, in a collective all of them must join).
  std::vector<size_t> from_samples;
  if (plan_.parallel.tp_size > 1) {
    for (size_t i = 0; i < step.seqs.size(); ++i) {
      if (takes_sampled_token(step.seqs[i])) from_samples.push_back(i);
    }
  } else {
    from_samples = requests_.placeholders();
  }
  std::vector<TokenFill> fills;
  for (size_t seq : from_samples) {
    auto row = last_rows_.find(step.seqs[seq].request_id);
    if (row == last_rows_.end()) {
      return failed_precondition("request " + std::to_string(step.seqs[seq].request_id) +
                                 " takes the token sampled in the step before, which did not "
                                 "sample it");
    }
    fills.push_back({seq, row->second});
  }
  const StepBatch batch = requests_.batch(step, std::move(fills));
  TESSERA_RETURN_IF_ERROR(backend_->launch(batch, return_logits_));
  r.launched = true;
  last_rows_.clear();
  for (const SampleRequest& q : batch.rows()) last_rows_.emplace(q.request_id, last_rows_.size());
  if (!samples()) return Status::ok();
  r.rows.reserve(batch.rows().size());
  for (const SampleRequest& q : batch.rows()) {
    requests_.expect_sample(q.request_id);
    r.rows.push_back(q.request_id);
  }
  return Status::ok();
}

Expected<StepOutput> ModelRunner::collect() {
  if (running_.empty()) return failed_precondition("no step is running on this actor");
  Running r = std::move(running_.front());
  running_.pop_front();
  // The actor's time of this step: from its submit, or from when the step before it was handed
  // back if that was later (two running steps overlap; their times add up to the wall time).
  const auto begin = std::max(r.submitted, last_collected_);
  StepOutput out;
  out.step_id = r.step_id;
  Status st = r.error;
  if (st.is_ok() && r.launched) {
    auto samples = backend_->collect(return_logits_ ? &out.logits : nullptr);
    if (samples) {
      for (size_t i = 0; i < samples->size() && i < r.rows.size(); ++i) {
        requests_.record_sample(r.rows[i], (*samples)[i].token);
        out.outputs.push_back({r.rows[i], std::move((*samples)[i])});
      }
      out.gpu_micros = backend_->last_gpu_micros();
    } else {
      st = samples.status();
    }
  }
  last_collected_ = std::chrono::steady_clock::now();
  if (!st.is_ok()) return st;
  out.actor_micros = static_cast<uint32_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(last_collected_ - begin).count());
  return out;
}

bool ModelRunner::ready() const {
  return running_.empty() || !running_.front().launched || backend_->collect_ready();
}

bool ModelRunner::can_launch_ahead(const StepInput& step) const {
  if (running_.size() != 1 || return_logits_) return false;
  auto pending = [&](uint64_t id) {
    auto it = requests_.find(id);
    return it != nullptr && it->pending_samples > 0 ? it : nullptr;
  };
  for (uint64_t id : step.finished) {
    if (pending(id) != nullptr) return false;
  }
  for (const SeqStep& s : step.seqs) {
    const RequestState* r = pending(s.request_id);
    if (r == nullptr) continue;
    if (!takes_sampled_token(s) || r->sampling.penalised()) return false;
  }
  return true;
}

}  // namespace tessera
