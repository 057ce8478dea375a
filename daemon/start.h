// `tessera start` and `tessera stop`: run a node daemon on this machine, in the foreground or
// daemonized, and stop the daemons started from a temp root.
#pragma once

#include <cstdint>
#include <string>

namespace tessera {

struct StartOptions {
  bool head = false;
  std::string address;   // the head to join ("host:port"); exclusive with head
  int port = -1;         // -1 = 6380 for a head, any free port for a member
  bool block = false;    // stay in the foreground, log to stderr
  std::string temp_dir;  // see session.h
  std::string node_ip;
  std::string node_name;
  std::string bind_host = "0.0.0.0";
  uint64_t object_store_memory = 2ull << 30;
  uint32_t heartbeat_ms = 1000;
  uint32_t missed_beats = 5;
  std::string nvml_library;
  std::string log_level;
  std::string bin_dir;
};

// Runs the command; returns the process exit code. Prints what happened and what to do next.
int start_command(const StartOptions& options);

struct StopOptions {
  std::string temp_dir;
  uint32_t timeout_s = 10;  // SIGTERM, then SIGKILL after this long
};
int stop_command(const StopOptions& options);

}  // namespace tessera
