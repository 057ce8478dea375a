#include "daemon/head_link.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>

#include <algorithm>

namespace tessera {

HeadLink::HeadLink(kj::AsyncIoContext& io, std::string head_address, std::string self,
                   std::string token, std::string node_secret)
    : io_(io),
      head_address_(std::move(head_address)),
      self_(std::move(self)),
      token_(std::move(token)),
      node_secret_(std::move(node_secret)),
      tasks_(*this) {}

HeadLink::~HeadLink() = default;

void HeadLink::taskFailed(kj::Exception&& exception) {
  spdlog::warn("head link task failed: {}", exception.getDescription().cStr());
}

kj::Promise<Status> HeadLink::connect(kj::Duration timeout) {
  return rpc::connect(io_, head_address_, self_, token_, timeout)
      .then([this](Expected<kj::Own<rpc::Connection>>&& conn) -> Status {
        if (!conn) return conn.status().with_context("cannot join the cluster");
        if ((*conn)->role != proto::Role::HEAD || !(*conn)->has_cluster) {
          return failed_precondition("cannot join the cluster: " + head_address_ + " is a " +
                                     rpc::role_name((*conn)->role) +
                                     ", not a head; pass the head's address to --address");
        }
        sockaddr_storage addr{};
        uint len = sizeof(addr);
        (*conn)->stream->getsockname(reinterpret_cast<sockaddr*>(&addr), &len);
        char host[INET6_ADDRSTRLEN] = {0};
        if (addr.ss_family == AF_INET) {
          inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&addr)->sin_addr, host, sizeof(host));
        } else if (addr.ss_family == AF_INET6) {
          inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(&addr)->sin6_addr, host,
                    sizeof(host));
        }
        local_ip_ = host;
        conn_ = kj::mv(*conn);
        return Status::ok();
      });
}

kj::Promise<Status> HeadLink::do_register() {
  auto req = conn_->cluster.registerNodeRequest();
  node_->fill_info(req.initInfo());
  req.setNode(node_->client());
  req.setNodeSecret(
      kj::arrayPtr(reinterpret_cast<const kj::byte*>(node_secret_.data()), node_secret_.size()));
  return req.send().then(
      [this](capnp::Response<proto::Cluster::RegisterNodeResults>&& r) -> Status {
        session_ = r.getSession();
        registered_ = true;
        heartbeat_ms_ = std::max<uint32_t>(r.getHeartbeatMs(), 10);
        missed_beats_ = std::max<uint32_t>(r.getMissedBeats(), 1);
        spdlog::info("registered with head {} as {} (heartbeat every {} ms)", head_address_,
                     r.getNodeId().cStr(), heartbeat_ms_);
        return Status::ok();
      },
      [this](kj::Exception&& e) -> Status {
        return rpc::to_status(e).with_context("cannot register with head " + head_address_);
      });
}

kj::Promise<Status> HeadLink::register_and_beat(NodeService& node) {
  node_ = &node;
  return do_register().then([this](Status st) {
    if (st) tasks_.add(beat_loop());
    return st;
  });
}

kj::Promise<void> HeadLink::beat_loop() {
  return io_.provider->getTimer()
      .afterDelay(heartbeat_ms_ * kj::MILLISECONDS)
      .then([this]() -> kj::Promise<void> {
        if (leaving_ || !registered_) return kj::READY_NOW;
        auto req = session_.heartbeatRequest();
        auto usage = req.initUsage();
        auto res = node_->resources();
        usage.setMemoryAvailable(res.memory_available);
        auto used = usage.initGpuMemoryUsed(static_cast<unsigned>(res.gpus.size()));
        for (size_t i = 0; i < res.gpus.size(); ++i) {
          used.set(static_cast<unsigned>(i), res.gpus[i].memory_used);
        }
        usage.setActors(static_cast<uint32_t>(node_->actors().live_count()));
        // A head that does not answer within its own dead-node window is as good as gone.
        auto window = heartbeat_ms_ * missed_beats_ * kj::MILLISECONDS;
        return io_.provider->getTimer()
            .timeoutAfter(window, req.send().ignoreResult())
            .then([this]() { return beat_loop(); },
                  [this, window](kj::Exception&& e) -> kj::Promise<void> {
                    if (leaving_) return kj::READY_NOW;
                    Status st = rpc::to_status(e);
                    std::string why = st.message().find("timed out") != std::string::npos
                                          ? "no answer within " +
                                                std::to_string(window / kj::MILLISECONDS) +
                                                " ms (the head is stopped or overloaded)"
                                          : st.message();
                    spdlog::warn("heartbeat to head {} failed: {}; reconnecting", head_address_,
                                 why);
                    registered_ = false;
                    conn_ = nullptr;  // drop the stuck connection; a fresh one re-registers
                    session_ = nullptr;
                    return reconnect_loop(0);
                  });
      });
}

kj::Promise<void> HeadLink::reconnect_loop(uint32_t attempt) {
  uint32_t delay_ms = std::min<uint32_t>(500u << std::min<uint32_t>(attempt, 4), 5000);
  return io_.provider->getTimer()
      .afterDelay(delay_ms * kj::MILLISECONDS)
      .then([this]() { return connect(5 * kj::SECONDS); })
      .then([this](Status st) -> kj::Promise<Status> {
        if (!st) return st;
        return do_register();
      })
      .then([this, attempt](Status st) -> kj::Promise<void> {
        if (leaving_) return kj::READY_NOW;
        if (!st) {
          spdlog::warn("rejoining the cluster failed (attempt {}): {}", attempt + 1, st.message());
          return reconnect_loop(attempt + 1);
        }
        spdlog::info("rejoined the cluster at {}", head_address_);
        return beat_loop();
      });
}

kj::Promise<void> HeadLink::leave(const std::string& reason, kj::Duration timeout) {
  leaving_ = true;
  if (!registered_) return kj::READY_NOW;
  auto req = session_.leaveRequest();
  req.setReason(reason);
  return io_.provider->getTimer()
      .timeoutAfter(timeout, req.send().ignoreResult())
      .catch_([](kj::Exception&& e) {
        spdlog::warn("could not tell the head this node is leaving: {}", e.getDescription().cStr());
      });
}

}  // namespace tessera
