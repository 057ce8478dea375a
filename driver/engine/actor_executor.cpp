#include "driver/engine/actor_executor.h"

#include <chrono>

#include "protocol/rpc.h"

namespace tessera {

Status ActorExecutor::explain(Status failed) {
  if (lease_ == nullptr || failed.is_ok()) return failed;
  if (failed.code() != Code::kUnavailable && failed.code() != Code::kDeadlineExceeded) {
    return failed;
  }
  // A dropped connection arrives before the daemon's death report: wait a moment for it.
  auto death = lease_->wait_for_death(actor_id_, std::chrono::seconds(3));
  if (!death) return failed;
  return unavailable(describe_death(*death));
}

Expected<LoadedModel> ActorExecutor::load(const LoadOptions& o) {
  auto req = actor_.capability().loadModelRequest();
  auto spec = req.initSpec();
  spec.setModelDir(o.model_dir);
  spec.setDtype(o.dtype);
  spec.setKvBlocks(o.kv_blocks);
  spec.setBlockSize(o.block_size);
  spec.setMaxModelLen(o.max_model_len);
  spec.setReturnLogits(o.return_logits);
  spec.setDevice(o.device);
  spec.setGpuMemoryUtilization(o.gpu_memory_utilization);
  spec.setEnforceEager(o.enforce_eager);
  spec.setMaxNumSeqs(o.max_num_seqs);
  spec.setMaxNumBatchedTokens(o.max_num_batched_tokens);
  auto loaded = wait_for(loop_, req.send().then([](auto&& r) {
    auto i = r.getInfo();
    LoadedModel m;
    m.architecture = i.getArchitecture().cStr();
    m.vocab_size = i.getVocabSize();
    m.num_layers = i.getNumLayers();
    m.kv_blocks = i.getKvBlocks();
    m.block_size = i.getBlockSize();
    m.max_model_len = i.getMaxModelLen();
    m.weight_bytes = i.getWeightBytes();
    m.backend = i.getBackend().cStr();
    m.dtype = i.getDtype().cStr();
    m.device_name = i.getDeviceName().cStr();
    m.kv_cache_bytes = i.getKvCacheBytes();
    m.max_num_seqs = i.getMaxNumSeqs();
    m.max_num_batched_tokens = i.getMaxNumBatchedTokens();
    return m;
  }),
                         "load model", 30 * 60 * kj::SECONDS);
  if (!loaded) return explain(loaded.status());
  return loaded;
}

Expected<StepResult> ActorExecutor::execute(const StepBatch& batch) {
  auto req = actor_.capability().executeRequest();
  auto step = req.initStep();
  auto seqs = step.initSeqs(static_cast<unsigned>(batch.seqs.size()));
  for (size_t i = 0; i < batch.seqs.size(); ++i) {
    const SeqWork& w = batch.seqs[i];
    auto s = seqs[static_cast<unsigned>(i)];
    s.setRequestId(w.request_id);
    auto tokens = s.initTokens(static_cast<unsigned>(w.tokens.size()));
    for (size_t t = 0; t < w.tokens.size(); ++t) tokens.set(static_cast<unsigned>(t), w.tokens[t]);
    s.setStartPosition(w.start_position);
    auto blocks = s.initBlockTable(static_cast<unsigned>(w.block_table.size()));
    for (size_t b = 0; b < w.block_table.size(); ++b) {
      blocks.set(static_cast<unsigned>(b), w.block_table[b]);
    }
    s.setSample(w.sample);
    s.setFirst(w.first);
    if (w.first) {
      auto prompt = s.initPromptIds(static_cast<unsigned>(w.prompt.size()));
      for (size_t t = 0; t < w.prompt.size(); ++t)
        prompt.set(static_cast<unsigned>(t), w.prompt[t]);
      auto p = s.initSampling();
      p.setTemperature(w.sampling.temperature);
      p.setTopK(w.sampling.top_k);
      p.setTopP(w.sampling.top_p);
      p.setMinP(w.sampling.min_p);
      p.setHasSeed(w.sampling.seed.has_value());
      p.setSeed(w.sampling.seed.value_or(0));
      p.setRepetitionPenalty(w.sampling.repetition_penalty);
      p.setPresencePenalty(w.sampling.presence_penalty);
      p.setFrequencyPenalty(w.sampling.frequency_penalty);
      p.setLogprobs(w.sampling.logprobs);
    }
  }
  auto finished = step.initFinished(static_cast<unsigned>(batch.finished.size()));
  for (size_t i = 0; i < batch.finished.size(); ++i) {
    finished.set(static_cast<unsigned>(i), batch.finished[i]);
  }
  std::vector<float>* logits = &last_logits_;
  StepTimes* times = &last_times_;
  const auto t0 = std::chrono::steady_clock::now();
  auto result = wait_for(loop_, req.send().then([logits, times, t0](auto&& r) {
    StepResult result;
    auto out = r.getOutput();
    for (auto o : out.getOutputs()) {
      SampledToken s;
      s.request_id = o.getRequestId();
      s.token.token = o.getToken();
      s.token.logprob = o.getLogprob();
      for (auto t : o.getTop()) s.token.top.emplace_back(t.getToken(), t.getLogprob());
      result.sampled.push_back(std::move(s));
    }
    logits->clear();
    for (float v : out.getLogits()) logits->push_back(v);
    times->call_us = static_cast<uint32_t>(
        std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0)
            .count());
    times->actor_us = out.getActorMicros();
    times->gpu_us = out.getGpuMicros();
    return result;
  }),
                         "execute step", 10 * 60 * kj::SECONDS);
  if (!result) return explain(result.status());
  return result;
}

}  // namespace tessera
