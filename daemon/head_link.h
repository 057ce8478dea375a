// A node daemon's membership in a cluster: registers with the head, heartbeats, and registers
// again after the head restarts, declares it dead, or stops answering (a heartbeat that gets no
// reply within the head's dead-node window drops the connection and reconnects).
//
// Single-threaded: lives on the daemon's kj event loop.
#pragma once

#include <kj/async-io.h>

#include <string>

#include "common/status.h"
#include "daemon/node_defaults.h"
#include "daemon/node_service.h"
#include "protocol/rpc.h"

namespace tessera {

class HeadLink final : private kj::TaskSet::ErrorHandler {
 public:
  // `self` names this daemon in the head's logs ("node daemon n-3f2a"); `token` is the cluster
  // token; `node_secret` binds this daemon's node id at the head (made at start-up).
  HeadLink(kj::AsyncIoContext& io, std::string head_address, std::string self, std::string token,
           std::string node_secret);
  ~HeadLink();
  HeadLink(const HeadLink&) = delete;
  HeadLink& operator=(const HeadLink&) = delete;

  // Connects to the head (hello + version check). Fails with a clear Status when the head is
  // unreachable, is not a head, or speaks another protocol version.
  kj::Promise<Status> connect(kj::Duration timeout);

  // The local IP address of the connection to the head: the address other nodes can reach
  // this one at. Valid after connect().
  std::string local_ip() const { return local_ip_; }

  // Registers `node` (its address must be set by now) and starts the heartbeat loop, which
  // reconnects and re-registers on its own after failures. `node` must outlive this link.
  kj::Promise<Status> register_and_beat(NodeService& node);

  // Tells the head this node is leaving (bounded by `timeout`); best effort.
  kj::Promise<void> leave(const std::string& reason, kj::Duration timeout);

  bool registered() const { return registered_; }

 private:
  kj::Promise<Status> do_register();
  kj::Promise<void> beat_loop();
  kj::Promise<void> reconnect_loop(uint32_t attempt);
  void taskFailed(kj::Exception&& exception) override;

  kj::AsyncIoContext& io_;
  std::string head_address_;
  std::string self_;
  std::string token_;
  std::string node_secret_;
  NodeService* node_ = nullptr;
  kj::Own<rpc::Connection> conn_;
  proto::NodeSession::Client session_{nullptr};
  uint32_t heartbeat_ms_ = node_defaults::kHeartbeatMs;
  uint32_t missed_beats_ = node_defaults::kMissedBeats;
  std::string local_ip_;
  bool registered_ = false;  // session_ is valid
  bool leaving_ = false;
  kj::TaskSet tasks_;
};

}  // namespace tessera
