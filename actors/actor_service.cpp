#include "actors/actor_service.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

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

 private:
  ActorService& service_;
};

class ActorGateway final : public proto::Gateway::Server {
 public:
  explicit ActorGateway(ActorService& service) : service_(service) {}

 protected:
  kj::Promise<void> hello(HelloContext context) override {
    auto p = context.getParams();
    rpc::require_version(p.getVersion(), p.getPeer(), proto::Role::ACTOR);
    auto r = context.getResults();
    r.setVersion(rpc::kProtocolVersion);
    r.setRole(proto::Role::ACTOR);
    r.setServerId(service_.identity().actor_id);
    r.setActor(kj::heap<ActorImpl>(service_));
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

proto::Gateway::Client ActorService::gateway() { return kj::heap<ActorGateway>(*this); }

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
