#include "actors/actor_service.h"

#include "actors/model/load_progress.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <optional>
#include <thread>

#include "common/shm_ring.h"
#include "protocol/convert.h"
#include "protocol/rpc.h"

namespace tessera {

namespace {

kj::ArrayPtr<const kj::byte> bytes_of(const std::string& s) {
  return kj::arrayPtr(reinterpret_cast<const kj::byte*>(s.data()), s.size());
}

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

  kj::Promise<void> prepareComm(PrepareCommContext context) override {
    auto p = context.getParams();
    auto r = service_.prepare_comm(p.getBackend().cStr(), p.getBufferBytes(), p.getRank(),
                                   p.getWorldSize());
    if (!r) rpc::throw_status(r.status());
    context.getResults().setAddress(r->address);
    context.getResults().setNcclId(bytes_of(r->nccl_id));
    context.getResults().setIpcHandle(bytes_of(r->ipc_handle));
    return kj::READY_NOW;
  }

  kj::Promise<void> loadModel(LoadModelContext context) override {
    return service_.load_model(from_proto(context.getParams().getSpec()))
        .then([context](Expected<ModelInfo>&& info) mutable {
          if (!info) rpc::throw_status(info.status());
          to_proto(*info, context.getResults().initInfo());
        });
  }

  kj::Promise<void> commCheck(CommCheckContext context) override {
    auto p = context.getParams();
    return service_
        .comm_check(from_proto(p.getSpec()), p.getBytes(), static_cast<int>(p.getIterations()))
        .then([context](Expected<std::vector<ActorService::GroupCheck>>&& checks) mutable {
          if (!checks) rpc::throw_status(checks.status());
          auto list = context.getResults().initGroups(static_cast<unsigned>(checks->size()));
          for (size_t i = 0; i < checks->size(); ++i) {
            const auto& c = (*checks)[i];
            auto b = list[static_cast<unsigned>(i)];
            b.setGroup(c.group);
            b.setRanks(static_cast<uint32_t>(c.ranks));
            b.setBytes(c.result.bytes);
            b.setIterations(static_cast<uint32_t>(c.result.iterations));
            b.setMedianUs(c.result.median_us);
            b.setBusBandwidthGbps(c.result.busbw_gbps);
          }
        });
  }

  kj::Promise<void> p2pCheck(P2pCheckContext context) override {
    uint64_t bytes = context.getParams().getBytes();
    if (bytes == 0 || bytes > (1ull << 30)) {
      rpc::throw_status(invalid_argument("a P2P check copies 1 B to 1 GiB"));
    }
    auto copies = comm::run_p2p_check(bytes);
    if (!copies) rpc::throw_status(copies.status());
    auto list = context.getResults().initCopies(static_cast<unsigned>(copies->size()));
    for (size_t i = 0; i < copies->size(); ++i) {
      const auto& c = (*copies)[i];
      auto b = list[static_cast<unsigned>(i)];
      b.setSrc(static_cast<uint32_t>(c.src));
      b.setDst(static_cast<uint32_t>(c.dst));
      b.setPeerAccess(c.peer_access);
      b.setOk(c.ok);
      b.setGbps(c.gbps);
      b.setError(c.error);
    }
    return kj::READY_NOW;
  }

  kj::Promise<void> loadProgress(LoadProgressContext context) override {
    auto [done, total] = service_.load_progress();
    context.getResults().setBytesDone(done);
    context.getResults().setBytesTotal(total);
    return kj::READY_NOW;
  }

  kj::Promise<void> expertLoad(ExpertLoadContext context) override {
    to_proto(service_.expert_load(), context.getResults().initLoad());
    return kj::READY_NOW;
  }

  kj::Promise<void> initCache(InitCacheContext context) override {
    auto info = service_.init_cache(context.getParams().getKvBlocks());
    if (!info) rpc::throw_status(info.status());
    to_proto(*info, context.getResults().initInfo());
    return kj::READY_NOW;
  }

  kj::Promise<void> execute(ExecuteContext context) override {
    auto out = service_.execute(from_proto(context.getParams().getStep()));
    if (!out) rpc::throw_status(out.status());
    to_proto(*out, context.getResults().initOutput());
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

ActorService::~ActorService() {
  if (load_thread_.joinable()) load_thread_.join();  // a load cannot be interrupted: let it end
  stop_steps();
  loaded_.store(nullptr, std::memory_order_release);
  runner_.reset();  // before the communicators it uses
  comms_.reset();
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

kj::Promise<void> ActorService::on_shutdown() { return shutdown_.addBranch(); }

void ActorService::request_shutdown() {
  if (shutdown_fulfiller_->isWaiting()) shutdown_fulfiller_->fulfill();
}

Expected<ActorService::PreparedComm> ActorService::prepare_comm(const std::string& backend,
                                                                uint64_t buffer_bytes, int tp_rank,
                                                                int tp_size) {
  if (runner_) return failed_precondition("a model is loaded already: start a new actor");
  if (load_thread_.joinable()) return failed_precondition("a model is loading already");
  TESSERA_ASSIGN_OR_RETURN(
      comms_, comm::RankComms::prepare(backend, identity_.host, buffer_bytes, tp_rank, tp_size));
  return PreparedComm{comms_->address(), comms_->nccl_id(), comms_->ipc_handle()};
}

kj::Promise<Expected<ModelInfo>> ActorService::load_model(LoadSpec spec) {
  using Loaded = Expected<std::unique_ptr<ModelRunner>>;
  if (comms_used_) {
    return Expected<ModelInfo>(
        failed_precondition("this actor ran a collective check: load on a fresh actor"));
  }
  if (runner_ || load_thread_.joinable()) {
    return Expected<ModelInfo>(failed_precondition(
        runner_ ? "a model is loaded already: start a new actor" : "a model is loading already"));
  }
  if (spec.parallel.world_size() > 1 && !comms_) {
    return Expected<ModelInfo>(failed_precondition("a model of " +
                                                   std::to_string(spec.parallel.world_size()) +
                                                   " ranks needs prepareComm first"));
  }
  ::tessera::load_progress().start(0);
  auto paf = kj::newPromiseAndCrossThreadFulfiller<Loaded>();
  // The thread touches comms_ and the new runner only; the loop sees them again after it ends.
  // (kj::Own's destructor may throw, which std::thread's state may not: a shared_ptr holds it.)
  auto fulfiller =
      std::make_shared<kj::Own<kj::CrossThreadPromiseFulfiller<Loaded>>>(kj::mv(paf.fulfiller));
  load_thread_ = std::thread([this, spec, fulfiller]() {
    Loaded loaded = [&]() -> Loaded {
      StageComms stage;
      if (spec.parallel.world_size() > 1) {
        TESSERA_RETURN_IF_ERROR(comms_->join(spec));
        stage = comms_->stage();
      }
      return ModelRunner::load(spec, stage);
    }();
    (*fulfiller)->fulfill(std::move(loaded));
  });
  auto done =
      paf.promise
          .then([this, spec](Loaded&& runner) -> Expected<ModelInfo> {
            load_thread_.join();
            if (!runner) {
              spdlog::error("cannot load {}: {}", spec.engine.model, runner.status().message());
              return runner.status();
            }
            runner_ = std::move(*runner);
            loaded_.store(runner_.get(), std::memory_order_release);
            spec_ = spec;
            return runner_->info();
          })
          .eagerlyEvaluate(nullptr)
          .fork();
  auto branch = done.addBranch();
  load_done_ = kj::mv(done);
  return branch;
}

kj::Promise<Expected<std::vector<ActorService::GroupCheck>>> ActorService::comm_check(
    LoadSpec spec, uint64_t bytes, int iterations) {
  using Checks = Expected<std::vector<GroupCheck>>;
  if (runner_ || load_thread_.joinable() || comms_used_) {
    return Checks(failed_precondition(
        "this actor's collectives are in use already: a check runs on a fresh actor"));
  }
  if (!comms_ || spec.parallel.world_size() < 2) {
    return Checks(failed_precondition("a collective check needs prepareComm and two ranks"));
  }
  if (bytes > (1ull << 30) || iterations < 1 || iterations > 1000) {
    return Checks(invalid_argument("a check all-reduces 4 B to 1 GiB, 1 to 1000 times"));
  }
  comms_used_ = true;
  auto paf = kj::newPromiseAndCrossThreadFulfiller<Checks>();
  auto fulfiller =
      std::make_shared<kj::Own<kj::CrossThreadPromiseFulfiller<Checks>>>(kj::mv(paf.fulfiller));
  load_thread_ = std::thread([this, spec, bytes, iterations, fulfiller]() {
    Checks checks = [&]() -> Checks {
      TESSERA_RETURN_IF_ERROR(comms_->join(spec));
      const bool device = comms_->backend() != CommBackend::kTcp;
      std::vector<GroupCheck> out;
      const StageComms stage = comms_->stage();
      for (auto [name, group] :
           {std::pair<const char*, comm::Communicator*>{"tensor-parallel", stage.tp},
            {"pipeline", stage.pp}}) {
        if (group == nullptr) continue;
        auto r = comm::run_comm_check(*group, bytes, iterations, device);
        if (!r) return r.status().with_context(std::string("the ") + name + " group");
        out.push_back({name, group->size(), *r});
      }
      return out;
    }();
    (*fulfiller)->fulfill(std::move(checks));
  });
  auto done = paf.promise
                  .then([this](Checks&& checks) {
                    load_thread_.join();
                    if (!checks) spdlog::error("collective check: {}", checks.status().message());
                    return kj::mv(checks);
                  })
                  .eagerlyEvaluate(nullptr)
                  .fork();
  auto branch = done.addBranch();
  check_done_ = kj::mv(done);
  return branch;
}

std::pair<uint64_t, uint64_t> ActorService::load_progress() const {
  const LoadProgress& p = ::tessera::load_progress();
  return {p.bytes_done.load(), p.bytes_total.load()};
}

Expected<ModelInfo> ActorService::init_cache(int64_t blocks) {
  if (load_thread_.joinable()) return failed_precondition("the model is still loading");
  if (!runner_) return failed_precondition("no model is loaded on actor " + identity_.actor_id);
  TESSERA_RETURN_IF_ERROR(runner_->init_cache(blocks));
  if (!spec_.step_ring.empty() && !step_thread_.joinable()) {
    stopping_ = false;
    step_thread_ = std::thread([this] { step_loop(); });
  }
  return runner_->info();
}

Expected<StepOutput> ActorService::execute(const StepInput& step) {
  if (!runner_) {
    return failed_precondition("no model is loaded on actor " + identity_.actor_id +
                               "; call loadModel");
  }
  if (step_thread_.joinable()) {
    return failed_precondition("actor " + identity_.actor_id +
                               " takes its steps from the step ring, not over RPC");
  }
  step_started();
  auto out = runner_->execute(step);
  step_finished();
  steps_done_.fetch_add(1, std::memory_order_relaxed);
  return out;
}

void ActorService::step_loop() {
  auto in = ShmRing::open(spec_.step_ring);
  auto out = ShmRing::open(spec_.output_ring);
  if (!in || !out) {
    spdlog::error("actor {} cannot open its step rings: {}", identity_.actor_id,
                  (!in ? in.status() : out.status()).message());
    return;
  }
  auto reader = in->reader(spec_.step_ring_reader);
  auto writer = out->writer();
  if (!reader || !writer) {
    spdlog::error("actor {} cannot attach to its step rings: {}", identity_.actor_id,
                  (!reader ? reader.status() : writer.status()).message());
    return;
  }
  std::vector<std::byte> buffer(reader->slot_bytes());
  // When the last output went back: without async scheduling the driver's next step follows it
  // within its own bookkeeping (tens of microseconds), so the ring is polled from then on
  // (RingReader::read's poll_from) rather than slept on (a futex wake-up costs as much again).
  auto handed_back_at = std::chrono::steady_clock::time_point::min();
  // Hands back the oldest running step's output (or its error); false when that fails.
  auto hand_back = [&]() -> bool {
    const uint64_t step_id = runner_->oldest_step_id();
    auto done = runner_->collect();
    StepOutput result;
    if (done) {
      result = std::move(*done);
    } else {
      result.step_id = step_id;
      result.error = done.status().to_string();
      spdlog::warn("step {} failed on actor {}: {}", step_id, identity_.actor_id,
                   done.status().message());
    }
    if (runner_->running() > 0) {
      step_started();  // the next one's time counts from here
    } else {
      step_finished();
    }
    steps_done_.fetch_add(1, std::memory_order_relaxed);
    if (!runner_->samples()) {
      result.outputs.clear();  // only the sampling rank's tokens matter
      result.logits.clear();
    }
    Status st = writer->write(encode(result), std::chrono::minutes(10));
    if (!st) {
      spdlog::error("actor {}: cannot hand back step {}: {}", identity_.actor_id, result.step_id,
                    st.message());
    }
    handed_back_at = std::chrono::steady_clock::now();
    return st.is_ok();
  };
  auto submit = [&](const StepInput& step) {
    if (runner_->running() == 0) step_started();
    runner_->submit(step);
  };
  // Async scheduling (a step takes a sample as kSampledToken): the driver sends the next step
  // before it collects this one. The step is left running, and the next one is launched while it
  // runs, so the GPU goes from one to the next without waiting for the host.
  auto followed = [](const StepInput& step) {
    for (const SeqStep& s : step.seqs) {
      if (takes_sampled_token(s)) return true;
    }
    return false;
  };
  bool open = true;
  while (!stopping_ && open) {
    std::optional<size_t> message;
    const bool running = runner_->running() > 0;
    if (running) {
      // Wait for the next step or the end of this one on the device, whichever comes first.
      while (!stopping_) {
        auto n = reader->read(buffer, std::chrono::milliseconds(0));
        if (n) {
          message = *n;
          break;
        }
        if (n.status().code() != Code::kDeadlineExceeded) {
          if (n.status().code() != Code::kUnavailable) {
            spdlog::error("actor {}: step ring: {}", identity_.actor_id, n.status().message());
          }
          open = false;  // the driver closed the ring: no more steps
          break;
        }
        if (runner_->ready()) break;
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
    } else {
      auto n = reader->read(buffer, std::chrono::milliseconds(100), handed_back_at);
      if (!n) {
        if (n.status().code() == Code::kDeadlineExceeded) continue;
        if (n.status().code() != Code::kUnavailable) {
          spdlog::error("actor {}: step ring: {}", identity_.actor_id, n.status().message());
        }
        break;  // the driver closed the ring: no more steps
      }
      message = *n;
    }
    Expected<StepInput> step = failed_precondition("no step");
    if (message) step = decode_step_input(std::span<const std::byte>(buffer.data(), *message));
    if (running) {
      if (message && step && runner_->can_launch_ahead(*step)) {
        submit(*step);
        message.reset();
      }
      if (!hand_back()) return;
      if (!message) continue;
    }
    if (!step) {
      StepOutput result;
      result.error = step.status().to_string();
      if (!writer->write(encode(result), std::chrono::minutes(10))) return;
      continue;
    }
    submit(*step);
    if (!followed(*step) && !hand_back()) return;
  }
  while (runner_->running() > 0) {
    if (!hand_back()) return;
  }
}

void ActorService::stop_steps() {
  stopping_ = true;
  if (step_thread_.joinable()) step_thread_.join();
}

std::chrono::milliseconds ActorService::busy_for() const {
  int64_t started = step_started_ns_.load(std::memory_order_relaxed);
  if (started == 0) return std::chrono::milliseconds(0);
  auto now = std::chrono::steady_clock::now().time_since_epoch();
  return std::chrono::duration_cast<std::chrono::milliseconds>(now -
                                                               std::chrono::nanoseconds(started));
}

ExpertLoad ActorService::expert_load() const {
  const ModelRunner* runner = loaded_.load(std::memory_order_acquire);
  return runner != nullptr ? runner->expert_load() : ExpertLoad{};
}

uint64_t ActorService::step_progress() const {
  const ModelRunner* runner = loaded_.load(std::memory_order_acquire);
  return runner != nullptr ? runner->progress() : 0;
}

void ActorService::step_started() {
  auto now = std::chrono::steady_clock::now().time_since_epoch();
  step_started_ns_.store(std::chrono::duration_cast<std::chrono::nanoseconds>(now).count(),
                         std::memory_order_relaxed);
}

void ActorService::step_finished() { step_started_ns_.store(0, std::memory_order_relaxed); }

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
