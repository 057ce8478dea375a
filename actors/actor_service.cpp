#include "actors/actor_service.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>

#include "protocol/rpc.h"

namespace tessera {

namespace {

class ActorImpl final : public proto::Actor::Server {
 public:
  explicit ActorImpl(ActorService& service) : service_(service) {}

 protected:
  kj::Promise<void> health(HealthContext context) override {
    service_.fill_health(context.getResults().initHealth());
    return kj::READY_NOW;
  }
  kj::Promise<void> shutdown(ShutdownContext) override {
    spdlog::info("shutdown requested over RPC");
    service_.request_shutdown();
    return kj::READY_NOW;
  }

  kj::Promise<void> loadModel(LoadModelContext context) override {
    auto p = context.getParams().getSpec();
    RunnerLoadSpec spec;
    spec.model_dir = p.getModelDir().cStr();
    spec.dtype = p.getDtype().size() ? p.getDtype().cStr() : "auto";
    spec.kv_blocks = p.getKvBlocks();
    spec.block_size = p.getBlockSize() ? p.getBlockSize() : 16;
    spec.max_model_len = p.getMaxModelLen();
    spec.return_logits = p.getReturnLogits();
    spec.device = p.getDevice().size() ? p.getDevice().cStr() : "auto";
    spec.gpu_memory_utilization = p.getGpuMemoryUtilization();
    spec.enforce_eager = p.getEnforceEager();
    spec.max_num_seqs = p.getMaxNumSeqs() ? p.getMaxNumSeqs() : 256;
    spec.max_num_batched_tokens = p.getMaxNumBatchedTokens();
    auto runner = ModelRunner::load(spec);
    if (!runner) {
      spdlog::error("cannot load {}: {}", spec.model_dir, runner.status().message());
      rpc::throw_status(runner.status());
    }
    auto info = context.getResults().initInfo();
    const ModelConfig& c = (*runner)->config();
    info.setArchitecture(architecture_name(c.arch));
    info.setVocabSize(static_cast<uint32_t>(c.vocab_size));
    info.setNumLayers(static_cast<uint32_t>(c.num_layers));
    info.setKvBlocks(static_cast<uint32_t>((*runner)->kv_blocks()));
    info.setBlockSize(static_cast<uint32_t>((*runner)->block_size()));
    info.setMaxModelLen(static_cast<uint32_t>((*runner)->max_model_len()));
    info.setWeightBytes((*runner)->weight_bytes());
    const RunnerInfo& ri = (*runner)->info();
    info.setBackend(ri.backend);
    info.setDtype(dtype_name(ri.dtype));
    info.setDeviceName(ri.device_name);
    info.setKvCacheBytes(ri.kv_cache_bytes);
    info.setMaxNumSeqs(static_cast<uint32_t>(ri.max_num_seqs));
    info.setMaxNumBatchedTokens(static_cast<uint32_t>(ri.max_num_batched_tokens));
    service_.set_runner(std::move(*runner));
    return kj::READY_NOW;
  }

  kj::Promise<void> execute(ExecuteContext context) override {
    ModelRunner* runner = service_.runner();
    if (runner == nullptr) {
      rpc::throw_status(failed_precondition("no model is loaded on actor " +
                                            service_.identity().actor_id + "; call loadModel"));
    }
    auto step = context.getParams().getStep();
    std::vector<RunnerSeq> seqs;
    for (auto s : step.getSeqs()) {
      RunnerSeq r;
      r.request_id = s.getRequestId();
      for (auto t : s.getTokens()) r.tokens.push_back(t);
      r.start_position = s.getStartPosition();
      for (auto b : s.getBlockTable()) r.block_table.push_back(b);
      r.sample = s.getSample();
      r.first = s.getFirst();
      if (r.first) {
        for (auto t : s.getPromptIds()) r.prompt.push_back(t);
        auto p = s.getSampling();
        r.sampling.temperature = p.getTemperature();
        r.sampling.top_k = p.getTopK();
        r.sampling.top_p = p.getTopP();
        r.sampling.min_p = p.getMinP();
        if (p.getHasSeed()) r.sampling.seed = p.getSeed();
        r.sampling.repetition_penalty = p.getRepetitionPenalty();
        r.sampling.presence_penalty = p.getPresencePenalty();
        r.sampling.frequency_penalty = p.getFrequencyPenalty();
        r.sampling.logprobs = p.getLogprobs();
      }
      seqs.push_back(std::move(r));
    }
    std::vector<uint64_t> finished;
    for (auto f : step.getFinished()) finished.push_back(f);
    std::vector<float> logits;
    const auto t0 = std::chrono::steady_clock::now();
    service_.step_started();
    auto outputs = runner->execute(seqs, finished, &logits);
    service_.step_finished();
    const auto actor_us =
        std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0)
            .count();
    if (!outputs) rpc::throw_status(outputs.status());
    auto out = context.getResults().initOutput();
    auto list = out.initOutputs(static_cast<unsigned>(outputs->size()));
    for (size_t i = 0; i < outputs->size(); ++i) {
      const auto& o = (*outputs)[i];
      auto b = list[static_cast<unsigned>(i)];
      b.setRequestId(o.request_id);
      b.setToken(o.result.token);
      b.setLogprob(o.result.logprob);
      auto top = b.initTop(static_cast<unsigned>(o.result.top_logprobs.size()));
      for (size_t j = 0; j < o.result.top_logprobs.size(); ++j) {
        top[static_cast<unsigned>(j)].setToken(o.result.top_logprobs[j].first);
        top[static_cast<unsigned>(j)].setLogprob(o.result.top_logprobs[j].second);
      }
    }
    out.setActorMicros(static_cast<uint32_t>(actor_us));
    out.setGpuMicros(runner->last_gpu_micros());
    auto l = out.initLogits(static_cast<unsigned>(logits.size()));
    for (size_t i = 0; i < logits.size(); ++i) l.set(static_cast<unsigned>(i), logits[i]);
    return kj::READY_NOW;
  }

 private:
  ActorService& service_;
};

}  // namespace

ActorService::ActorService(ActorIdentity identity, CudaProbe probe)
    : identity_(std::move(identity)), probe_(std::move(probe)), shutdown_(nullptr) {
  auto paf = kj::newPromiseAndFulfiller<void>();
  shutdown_ = paf.promise.fork();
  shutdown_fulfiller_ = kj::mv(paf.fulfiller);
}

rpc::Endpoint ActorService::endpoint(const std::string& key) {
  rpc::Endpoint e;
  e.role = proto::Role::ACTOR;
  e.server_id = identity_.actor_id;
  e.secret = key;
  e.grant = [this](proto::Handshake::AuthenticateResults::Builder out) {
    out.setActor(kj::heap<ActorImpl>(*this));
  };
  return e;
}

std::chrono::milliseconds ActorService::busy_for() const {
  int64_t started = step_started_ns_.load(std::memory_order_relaxed);
  if (started == 0) return std::chrono::milliseconds(0);
  auto now = std::chrono::steady_clock::now().time_since_epoch();
  return std::chrono::duration_cast<std::chrono::milliseconds>(now -
                                                               std::chrono::nanoseconds(started));
}

void ActorService::step_started() {
  auto now = std::chrono::steady_clock::now().time_since_epoch();
  step_started_ns_.store(std::chrono::duration_cast<std::chrono::nanoseconds>(now).count(),
                         std::memory_order_relaxed);
}

void ActorService::step_finished() { step_started_ns_.store(0, std::memory_order_relaxed); }

kj::Promise<void> ActorService::on_shutdown() { return shutdown_.addBranch(); }

void ActorService::request_shutdown() {
  if (shutdown_fulfiller_->isWaiting()) shutdown_fulfiller_->fulfill();
}

void ActorService::fill_health(proto::ActorHealth::Builder out) const {
  out.setActorId(identity_.actor_id);
  out.setPid(::getpid());
  out.setUptimeMs(static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                            std::chrono::steady_clock::now() - started_)
                                            .count()));
  out.setBackend(probe_.available ? "cuda" : "cpu");
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  out.setVisibleDevices(visible != nullptr ? visible : "");
  auto devices = out.initDevices(static_cast<unsigned>(probe_.devices.size()));
  for (size_t i = 0; i < probe_.devices.size(); ++i) {
    const auto& d = probe_.devices[i];
    auto b = devices[static_cast<unsigned>(i)];
    b.setIndex(static_cast<uint32_t>(d.ordinal));
    b.setName(d.name);
    b.setUuid(d.uuid);
    b.setPciBusId(d.pci_bus_id);
    b.setMemoryTotal(d.memory_total);
    b.setMemoryUsed(d.memory_total - d.memory_free);
  }
  out.setNcclVersion(probe_.nccl_version);
  out.setNote(probe_.available ? "" : probe_.note);
}

}  // namespace tessera
