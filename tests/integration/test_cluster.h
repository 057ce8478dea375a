// Test support: run the real `tessera` binary, and a throwaway cluster of real daemons in its own
// temp root.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <string>
#include <vector>

namespace tessera::testing {

struct CommandResult {
  int exit_code = -1;  // -1 when killed by a signal or timed out
  std::string out;
  std::string err;
  bool timed_out = false;
};

// Runs argv with a deadline, capturing stdout and stderr. `env` entries ("NAME=value") are added
// to (or replace in) the environment; `max_fds` > 0 sets the child's RLIMIT_NOFILE.
CommandResult run_command(const std::vector<std::string>& argv,
                          std::chrono::milliseconds timeout = std::chrono::seconds(60),
                          const std::vector<std::string>& env = {}, int max_fds = 0);

// $TESSERA_BIN_DIR (set by ctest) + "/" + name.
std::string bin(const std::string& name);

// Polls `pred` every 10 ms until it holds or `timeout` passes; returns its last value.
bool wait_until(const std::function<bool()>& pred, std::chrono::milliseconds timeout);

bool process_alive(int pid);

// A process started in the background, stdout and stderr to files, in a process group of its
// own (so a test can signal the group as a terminal's Ctrl-C would). Killed (SIGKILL to the
// group) on destruction if still running.
class BackgroundProcess {
 public:
  BackgroundProcess(const std::vector<std::string>& argv, const std::vector<std::string>& env = {});
  ~BackgroundProcess();
  int pid() const { return pid_; }
  // Waits up to `timeout` for it to exit; its wait status, or -1 if it still runs.
  int wait(std::chrono::milliseconds timeout);
  std::string out() const;
  std::string err() const;

 private:
  int pid_ = -1;
  bool reaped_ = false;
  std::string out_path_, err_path_;
};

// iproute2's `ip`, by its usual paths (root's PATH may lack /usr/sbin), else "ip".
std::string ip_binary();

// PIDs of running processes whose command line contains `needle`.
std::vector<int> processes_matching(const std::string& needle);
// A process's command line, arguments joined by spaces; "" when it has exited.
std::string cmdline_of(int pid);
// PIDs of running processes whose parent is `pid`.
std::vector<int> children_of(int pid);
// Every file under `dir` (recursively) whose name starts with `prefix`, joined.
std::string read_logs(const std::string& dir, const std::string& prefix);

// A cluster on this machine, in a fresh temp root. Stops every daemon it started on destruction.
class TestCluster {
 public:
  TestCluster();
  ~TestCluster();

  // `tessera start --head` with fast heartbeats (100 ms, dead after 5 missed; `extra` may set
  // --heartbeat-ms / --missed-heartbeats itself); returns the head's address ("" on failure,
  // with the command's output in last()).
  std::string start_head(const std::vector<std::string>& extra = {});
  // `tessera start --address <head>`; returns the member's node id ("" on failure).
  std::string start_member(const std::string& name, const std::vector<std::string>& extra = {});
  CommandResult tessera(std::vector<std::string> args,
                        std::chrono::milliseconds timeout = std::chrono::seconds(60),
                        const std::vector<std::string>& env = {}, int max_fds = 0);

  const std::string& root() const { return root_; }
  const std::string& head_address() const { return head_address_; }
  // The cluster token the head wrote into the root ("" before start_head).
  std::string token() const;
  // PID of the daemon with this node id (from its record), or -1.
  int daemon_pid(const std::string& node_id) const;
  const CommandResult& last() const { return last_; }

 private:
  std::string root_;
  std::string head_address_;
  CommandResult last_;
};

// Hosts for multi-host tests: network namespaces on one bridge (in a namespace of its own),
// host i at 10.214.<n>.<i + 1>/24; nothing is added to this machine's own namespace, and the
// namespaces go on destruction. ok() is false where namespaces cannot be made (no root): tests
// then fall back to loopback and say so.
class NetnsHosts {
 public:
  explicit NetnsHosts(size_t hosts);
  ~NetnsHosts();
  bool ok() const { return ok_; }
  size_t size() const { return names_.size(); }
  const std::string& addr(size_t host) const { return addrs_[host]; }
  // Moves the calling thread into host's namespace: the sockets it opens, the processes and
  // threads it starts from then on live there. A no-op when !ok().
  void enter(size_t host);
  // Back to the namespace the thread had at construction.
  void leave();

 private:
  std::vector<std::string> names_, addrs_;
  std::string bridge_;
  int home_fd_ = -1;
  bool ok_ = false;
};

}  // namespace tessera::testing
