// Starting and describing child processes (actors) of the node daemon.
//
// spawn_process forks and execs with an explicit environment, stdout+stderr appended to a log
// file, stdin from /dev/null, its own process group, and three pipes:
//   fd 3  ready:     the child writes "READY <port>\n" once it serves;
//   fd 4  secret:    the child reads its secret (the actor key) and then EOF;
//   fd 5  heartbeat: the child writes a byte every so often while it is healthy.
// The child gets SIGKILL if the daemon dies (PR_SET_PDEATHSIG), so a daemon crash leaves no
// orphan. The child holds no other descriptor of the daemon: every descriptor above 5 is made
// close-on-exec in the child before the exec (the daemon's sockets, its log, anything the daemon
// inherited). An exec failure (missing binary, not executable) is reported synchronously through
// a close-on-exec pipe, not as an exit code.
#pragma once

#include <sys/types.h>

#include <string>
#include <utility>
#include <vector>

#include "common/status.h"

namespace tessera {

struct ProcessSpec {
  std::string binary;                                    // absolute path
  std::vector<std::string> args;                         // argv[1..]
  std::vector<std::pair<std::string, std::string>> env;  // the whole environment
  std::string log_path;                                  // stdout + stderr, appended
  std::string secret;  // what the child reads from fd 4 (at most 4 KiB); kept off argv and env
};

struct SpawnedProcess {
  pid_t pid = -1;
  int ready_fd = -1;      // read end of the child's fd 3; the caller owns it
  int heartbeat_fd = -1;  // read end of the child's fd 5, non-blocking; the caller owns it
};

// The file descriptor numbers the child sees its pipes on.
inline constexpr int kReadyFd = 3;
inline constexpr int kSecretFd = 4;
inline constexpr int kHeartbeatFd = 5;

// Forks and execs `spec`. Fails with NOT_FOUND / PERMISSION_DENIED / INTERNAL naming the binary
// and the reason when the exec cannot happen; nothing is left running then.
Expected<SpawnedProcess> spawn_process(const ProcessSpec& spec);

// The actor executable: `bin_dir`/tessera-actor (the daemon's own folder unless the operator
// passed --actor-bin-dir). NOT_FOUND naming the path when it is missing, PERMISSION_DENIED
// when it is not executable.
Expected<std::string> resolve_actor_binary(const std::string& bin_dir);

// "exited with code 3", "killed by signal 9 (SIGKILL)" for a waitpid() status.
std::string describe_wait_status(int status);
// Exit code for a waitpid() status that is an exit, else -1.
int wait_exit_code(int status);
// Signal number for a waitpid() status that is a signal death, else 0.
int wait_term_signal(int status);

// The last `max_bytes` of a file (for error messages), "" when unreadable.
std::string tail_file(const std::string& path, size_t max_bytes = 2000);

// The directory holding the running executable (/proc/self/exe's folder).
std::string self_exe_dir();

// The environment of this process as name/value pairs.
std::vector<std::pair<std::string, std::string>> current_environment();

}  // namespace tessera
