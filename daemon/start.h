// `tessera start` and `tessera stop`: run a node daemon on this machine, in the foreground or
// daemonized, and stop the daemons started from a temp root (or, with --all, the whole cluster
// through its head).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "daemon/node_defaults.h"

namespace CLI {
class App;
}

namespace tessera {

struct StartOptions {
  bool head = false;
  std::string address;             // the head to join ("host:port"); exclusive with head
  int port = -1;                   // -1 = 6380 for a head, any free port for a member
  bool block = false;              // stay in the foreground, log to stderr
  std::string temp_dir;            // see common/session.h
  std::string cluster_token_file;  // head: use this token instead of a new one; members: required
                                   // unless TESSERA_CLUSTER_TOKEN or the temp root has it
  std::string node_ip;             // the address to listen on and advertise
  std::string bind_host;           // listen here instead (e.g. 0.0.0.0), advertise node_ip
  std::string node_name;
  uint64_t object_store_memory = node_defaults::kObjectStoreBytes;
  uint64_t shm_per_lease = 0;  // 0 = object_store_memory
  uint32_t heartbeat_ms = node_defaults::kHeartbeatMs;
  uint32_t missed_beats = node_defaults::kMissedBeats;
  uint32_t max_connections = 512;
  uint32_t max_message_mib = 64;
  uint32_t max_actors = node_defaults::kMaxActors;
  double actor_health_timeout_s = node_defaults::kActorHealthTimeoutMs / 1000.0;  // 0 = off
  double actor_step_timeout_s = node_defaults::kActorStepTimeoutMs / 1000.0;      // 0 = no limit
  std::vector<std::string> actor_env_allow;
  std::string nvml_library;
  // --gpus: the GPUs this node offers (NVML indices or UUIDs, comma-separated); unset: the
  // daemon's CUDA_VISIBLE_DEVICES when set (as Ray does), else every GPU.
  std::optional<std::string> gpus;
  std::string log_level;
  std::string bin_dir;
  bool ephemeral = false;  // remove the whole temp root on exit (embedded local nodes)
};

// Adds `start` to `app` with its flags bound to `options`: every field but log_level, which is
// `tessera --log-level` (the caller copies it in). The caller runs start_command when the
// subcommand was parsed.
CLI::App* add_start_subcommand(CLI::App& app, StartOptions& options);

// Runs the command; returns the process exit code. Prints what happened and what to do next.
int start_command(const StartOptions& options);

struct StopOptions {
  std::string temp_dir;
  uint32_t timeout_s = 10;  // SIGTERM, then SIGKILL after this long
  // --all: the whole cluster, through its head (Cluster.stopCluster), from any machine that
  // has the token. The head and the token are found as `tessera status` finds them.
  bool all = false;
  std::string address;             // the head's HOST:PORT; "" = $TESSERA_ADDRESS or this root's
  std::string cluster_token_file;  // else $TESSERA_CLUSTER_TOKEN or this root's token
};
// Adds `stop` to `app` with its flags bound to `options`; the caller runs stop_command.
CLI::App* add_stop_subcommand(CLI::App& app, StopOptions& options);
int stop_command(const StopOptions& options);

}  // namespace tessera
