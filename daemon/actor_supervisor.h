// The node daemon's actor processes: spawn with their environment, wait until they serve,
// reap them, report each death, kill them on request or when their owner goes away.
//
// Single-threaded: used from the daemon's kj event loop only. The process must have called
// kj::UnixEventPort::captureChildExit() before the event loop was created.
#pragma once

#include <kj/async-io.h>
#include <kj/async-unix.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "protocol/rpc.h"

namespace tessera {

enum class ActorState { kStarting, kReady, kDead };
const char* actor_state_name(ActorState state);

struct ActorRecord {
  std::string id;
  std::string owner;       // lease key of the owner
  std::string owner_name;  // the owner's own name, for display
  std::string name;        // the owner's label
  std::string binary;      // absolute path
  std::string log_path;
  std::string address;  // "host:port" once ready
  std::vector<uint32_t> gpus;
  pid_t pid = -1;
  ActorState state = ActorState::kStarting;
  int exit_code = -1;
  int term_signal = 0;
  std::string death_reason;
};

struct ActorSpawnRequest {
  std::string binary;  // "" = tessera-actor
  std::vector<std::string> args;
  std::vector<uint32_t> gpus;
  std::vector<std::pair<std::string, std::string>> env;
  std::string name;
  uint32_t ready_timeout_ms = 0;  // 0 = 30 s
};

struct SupervisorConfig {
  std::string node_id;
  std::string bin_dir;            // where bare binary names are looked up
  std::string log_dir;            // actor-<id>.log files go here
  std::string listen_host;        // the host actors bind and advertise
  uint32_t gpu_count = 0;         // GPUs on this node: requests for others are refused
  uint32_t kill_grace_ms = 3000;  // SIGTERM → SIGKILL delay
  // Environment variables passed from the daemon to every actor, by exact name or prefix "X*".
  std::vector<std::string> passthrough = {
      "PATH",   "HOME",   "USER",      "LANG",     "LC_ALL",         "TMPDIR", "LD_LIBRARY_PATH",
      "NCCL_*", "CUDA_*", "TESSERA_*", "NVIDIA_*", "OMP_NUM_THREADS"};
};

class ActorSupervisor final : private kj::TaskSet::ErrorHandler {
 public:
  ActorSupervisor(kj::AsyncIoContext& io, SupervisorConfig config);
  ~ActorSupervisor();
  ActorSupervisor(const ActorSupervisor&) = delete;
  ActorSupervisor& operator=(const ActorSupervisor&) = delete;

  // Called once for each actor that dies (after it is marked dead), however it died.
  void set_death_handler(std::function<void(const ActorRecord&)> handler);

  // Starts an actor for `owner` and resolves once it serves (state ready), or with an error
  // that names the cause and the tail of the actor's log. Never rejects.
  kj::Promise<Expected<ActorRecord>> spawn(const std::string& owner, const std::string& owner_name,
                                           const ActorSpawnRequest& request);

  // Signals an actor (SIGTERM, or SIGKILL when `force`). NOT_FOUND for an unknown or dead id;
  // PERMISSION_DENIED when `owner` is non-empty and does not own it.
  Status kill(const std::string& id, bool force, const std::string& owner = "");

  // SIGTERM to every live actor of `owner`, SIGKILL after the grace period.
  void kill_owner(const std::string& owner, const std::string& why);
  // SIGKILL to every live actor and waits (bounded) until all are reaped.
  void kill_all_now();

  // Live actors, then up to 50 recently dead ones.
  std::vector<ActorRecord> list() const;
  std::vector<ActorRecord> list_owner(const std::string& owner) const;
  size_t live_count() const;

 private:
  struct Entry;
  kj::Promise<void> watch_exit(std::string id, kj::Promise<int> exit);
  kj::Promise<Expected<std::string>> wait_ready(std::string id, int ready_fd, uint32_t timeout_ms);
  std::vector<std::pair<std::string, std::string>> actor_environment(
      const std::string& id, const ActorSpawnRequest& request) const;
  void on_exit(const std::string& id, int status);
  void taskFailed(kj::Exception&& exception) override;

  kj::AsyncIoContext& io_;
  SupervisorConfig config_;
  std::map<std::string, std::unique_ptr<Entry>> live_;
  std::deque<ActorRecord> dead_;
  std::function<void(const ActorRecord&)> on_death_;
  kj::TaskSet tasks_;
};

// "a-3f2a9c0d": a fresh random id with the given prefix.
std::string random_id(const std::string& prefix, size_t hex_digits = 8);

}  // namespace tessera
