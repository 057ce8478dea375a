// The node daemon's actor processes: spawn with their environment, wait until they serve,
// watch their heartbeats, reap them, report each death, kill them on request, when their owner
// goes away, or when they stop answering.
//
// The executable is always tessera-actor from the daemon's bin dir; requests carry no program,
// path or argument. Job variables from the wire are checked against an allow-list. Each actor
// gets a fresh key (its RPC secret, see protocol/auth.h) through a pipe; only the owner that
// spawned it learns the key.
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
#include "daemon/node_defaults.h"
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
  std::string last_log_line;  // when dead: the last line of its log
  bool hung = false;          // when dead: killed by the daemon after its heartbeat stopped
};

struct ActorSpawnRequest {
  std::vector<uint32_t> gpus;
  std::vector<std::pair<std::string, std::string>> env;  // the job's variables (checked)
  std::string name;
  uint32_t ready_timeout_ms = 0;  // 0 = 30 s
};

// A serving actor and the key its owner proves in the actor's handshake.
struct SpawnedActor {
  ActorRecord record;
  std::string key;
};

struct SupervisorConfig {
  std::string node_id;
  std::string bin_dir;            // where tessera-actor lives
  std::string log_dir;            // actor-<id>.log files go here
  std::string listen_host;        // the host actors bind and advertise
  // The GPUs this node offers, by NVML index (what spawn requests name): requests for others
  // are refused.
  std::vector<uint32_t> gpus;
  uint32_t kill_grace_ms = node_defaults::kKillGraceMs;  // SIGTERM → SIGKILL delay
  uint32_t max_actors = node_defaults::kMaxActors;       // live actors at once
  // An actor whose heartbeat stops this long is killed and reported hung; 0 = no watchdog.
  uint32_t health_timeout_ms = node_defaults::kActorHealthTimeoutMs;
  // An actor stops its heartbeat when one step runs longer than this (a stuck kernel); 0 = never.
  uint32_t step_timeout_ms = node_defaults::kActorStepTimeoutMs;
  // Environment variables passed from the daemon's own environment to every actor, by exact
  // name or prefix "X*" (never TESSERA_CLUSTER_TOKEN).
  std::vector<std::string> passthrough = {
      "PATH",   "HOME",   "USER",      "LANG",     "LC_ALL",         "TMPDIR", "LD_LIBRARY_PATH",
      "NCCL_*", "CUDA_*", "TESSERA_*", "NVIDIA_*", "OMP_NUM_THREADS"};
  // Names a request may set, by exact name or prefix "X*"; the daemon adds --actor-env-allow.
  std::vector<std::string> job_env_allow = {"NCCL_*", "CUDA_*", "TESSERA_*", "OMP_NUM_THREADS"};
};

// OK when every job variable may reach an actor: a name of [A-Z0-9_] matching `allow`, not
// one that names a path, file, directory, library or plugin (LD_PRELOAD, CUDA_INJECTION64_PATH,
// NCCL_NET_PLUGIN, NCCL_DEBUG_FILE, ...) nor one the daemon sets itself; values without NUL, at
// most 4 KiB; at most 64 of them. INVALID_ARGUMENT naming the first offender otherwise.
Status check_job_environment(const std::vector<std::pair<std::string, std::string>>& env,
                             const std::vector<std::string>& allow);

class ActorSupervisor final : private kj::TaskSet::ErrorHandler {
 public:
  ActorSupervisor(kj::AsyncIoContext& io, SupervisorConfig config);
  ~ActorSupervisor();
  ActorSupervisor(const ActorSupervisor&) = delete;
  ActorSupervisor& operator=(const ActorSupervisor&) = delete;

  const SupervisorConfig& config() const { return config_; }

  // Called once for each actor that dies (after it is marked dead), however it died.
  void set_death_handler(std::function<void(const ActorRecord&)> handler);

  // Starts an actor for `owner` and resolves once it serves (state ready), or with an error
  // that names the cause and the tail of the actor's log. Never rejects.
  kj::Promise<Expected<SpawnedActor>> spawn(const std::string& owner, const std::string& owner_name,
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
  // How a dead actor died ("was killed by signal 9 (SIGKILL)"), or "died" when not recorded.
  std::string death_of(const std::string& id) const;
  kj::Promise<void> watch_exit(std::string id, kj::Promise<int> exit);
  kj::Promise<void> read_beats(std::string id);
  kj::Promise<void> health_loop();
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
