// One node daemon: resources, actors, shared memory, the RPC server, and (as a head) the
// cluster registry or (as a member) the link to the head. `tessera start` runs one per node.
#pragma once

#include <kj/async-io.h>

#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"
#include "daemon/session.h"

namespace tessera {

struct DaemonConfig {
  bool head = false;
  std::string node_id;       // "" = a fresh random id ("n-3f2a9c0d1e")
  std::string head_address;  // members: the head's "host:port"
  std::string bind_host = "0.0.0.0";
  uint16_t port = 0;        // 0 = any free port
  std::string node_ip;      // advertised address; "" = detect
  std::string node_name;    // "" = hostname
  std::string session_dir;  // created by the caller (logs/ inside)
  std::string bin_dir;      // where tessera-actor lives; "" = next to this executable
  uint64_t object_store_bytes = 2ull << 30;
  uint32_t heartbeat_ms = 1000;
  uint32_t missed_beats = 5;
  uint32_t kill_grace_ms = 3000;
  std::string nvml_library;  // "" = libnvidia-ml.so.1 (or $TESSERA_NVML_LIBRARY)
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

  struct Impl;

 private:
  explicit Daemon(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace tessera
