// One node daemon: resources, actors, shared memory, the RPC server, and (as a head) the
// cluster registry or (as a member) the link to the head. `tessera start` runs one per node.
#pragma once

#include <kj/async-io.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "daemon/node_defaults.h"
#include "protocol/rpc.h"

namespace tessera {

struct DaemonConfig {
  bool head = false;
  std::string node_id;        // "" = a fresh random id ("n-3f2a9c0d1e")
  std::string head_address;   // members: the head's "host:port"
  std::string cluster_token;  // required: every connection proves it (protocol/auth.h)
  // Where to listen. "" = a head binds node_ip if given, else loopback only; a member binds the
  // address it reaches its head from (loopback when the head is on loopback).
  std::string bind_host;
  uint16_t port = 0;        // 0 = any free port
  std::string node_ip;      // advertised address; "" = the bind address (or detect for 0.0.0.0)
  std::string node_name;    // "" = hostname
  std::string session_dir;  // created by the caller (logs/ inside)
  std::string bin_dir;      // where tessera-actor lives; "" = next to this executable
  uint64_t object_store_bytes = node_defaults::kObjectStoreBytes;
  uint64_t shm_per_lease_bytes = 0;  // 0 = object_store_bytes
  uint32_t heartbeat_ms = node_defaults::kHeartbeatMs;
  uint32_t missed_beats = node_defaults::kMissedBeats;
  uint32_t kill_grace_ms = node_defaults::kKillGraceMs;
  uint32_t max_actors = node_defaults::kMaxActors;
  uint32_t actor_health_timeout_ms = node_defaults::kActorHealthTimeoutMs;  // 0 = no watchdog
  uint32_t actor_step_timeout_ms = node_defaults::kActorStepTimeoutMs;      // 0 = no limit
  std::vector<std::string> actor_env_allow;  // patterns added to NCCL_* CUDA_* TESSERA_* ...
  rpc::ServerLimits limits;
  std::string nvml_library;  // "" = libnvidia-ml.so.1 (or $TESSERA_NVML_LIBRARY)
  // The GPUs this node offers (ResourceMonitor::keep_gpus's list); none: every GPU found.
  std::optional<std::string> gpus;
  // true: the list is --gpus, every entry must name a GPU; false: CUDA_VISIBLE_DEVICES, read as
  // CUDA reads it (ResourceMonitor::keep_gpus's stopped_at).
  bool gpus_exact = true;
  uint32_t join_timeout_ms = 10000;
};

class Daemon {
 public:
  // Binds the port, discovers resources, joins or forms the cluster. Everything that can go
  // wrong at start-up (port in use, head unreachable, version mismatch) is a Status here.
  static Expected<std::unique_ptr<Daemon>> start(kj::AsyncIoContext& io, DaemonConfig config);
  ~Daemon();

  // Serves until shutdown() is called, an RPC asks for it, or SIGTERM/SIGINT arrives (the
  // caller must have captured those signals with kj::UnixEventPort::captureSignal before the
  // event loop was made). Then leaves the cluster, kills every actor, unlinks shared memory.
  kj::Promise<void> run();
  void shutdown(const std::string& why);

  std::string address() const;
  std::string node_id() const;
  // The address the RPC port is bound to ("127.0.0.1:6380", "0.0.0.0:6380").
  std::string bind_address() const;

  struct Impl;

 private:
  explicit Daemon(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tessera
