// Where Tessera keeps its files on this machine, how local commands find them, and how the
// leftovers of processes that died without cleaning up (SIGKILL, power loss) are recognised.
//
//   <root>/                        --temp-dir, else $TESSERA_TMPDIR, else /tmp/tessera-<uid>;
//                                  mode 0700, owned by the user (checked on every use)
//     head_address                 "host:port" of the head started here last
//     current_root                 (default root only) the --temp-dir of the last `tessera start`
//                                  given one, so status/stop/topo find that cluster unflagged
//     cluster_token                the cluster token the daemons started here use (0600)
//     start.lock                   held (flock) by a `tessera start` until its daemon serves
//     session_<date>_<pid>/        one per daemon process (pid = the daemon's)
//       owner                      "<pid> <start time>" of that daemon, written first
//       daemon.json                its record while it serves (address, role, node id, ...)
//       logs/                      daemon-<node>.log, actor-<id>.log
//     session_latest -> session_…  the newest session
//     local-XXXXXX/                an embedded local node of a driver command (a root of its
//       owner                      own), "<pid> <start time>" of that driver
//
// Shared-memory segments of a daemon are named /tessera-<pid>-<start time>-…, so a later start
// can tell a dead daemon's segments from a live one's, even after the pid has been reused.
//
// Used by the daemon (writes) and the driver (reads head address and token, makes local dirs).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace tessera {

// The temp root to use: `flag` if set, else $TESSERA_TMPDIR, else /tmp/tessera-<uid>. Creates it
// (mode 0700) if missing. FAILED_PRECONDITION, with the fix, when it exists but is not a
// directory owned by this user that only this user may write (another user could plant a
// record, a token or a symlink there).
Expected<std::string> open_root(const std::string& flag);

// The root of the cluster this machine belongs to, for the commands that look one up (status,
// stop, topo, plan, a driver given an address but no token), as `ray status` finds its cluster:
// `flag` if set; else the default root when a daemon was started from it; else the root that
// the last `tessera start --temp-dir DIR` recorded in the default root (current_root), when a
// daemon was started from that one; else the default root.
Expected<std::string> find_cluster_root(const std::string& flag);
// Records `root` in the default root's current_root (a no-op when it is the default root).
Status record_current_root(const std::string& root);

// Creates <root>/session_<date>_<pid>/logs for this process and its owner file, and points
// session_latest at it. Returns the session folder.
Expected<std::string> create_session_dir(const std::string& root);

// The record of a serving daemon, kept in its session folder while it runs.
struct DaemonRecord {
  int pid = 0;
  uint64_t start_time = 0;  // the process's start time (clock ticks after boot)
  std::string address;      // "host:port"
  std::string role;         // "head" or "node"
  std::string node_id;
  std::string session_dir;
  std::string head_address;  // the head this daemon joined (equal to address for a head)
  std::string executable;    // the daemon's program (/proc/self/exe); "" in older records
};

Status write_daemon_record(const DaemonRecord& record);
void remove_daemon_record(const DaemonRecord& record);
// Records of daemons still running under `root` (a record whose process is gone, or whose pid
// now belongs to another process, is stale and deleted).
std::vector<DaemonRecord> read_daemon_records(const std::string& root);

Status write_head_address(const std::string& root, const std::string& address);
// The head of the cluster this root's daemons belong to: the head started here, else the head
// a running member daemon started here joined. NOT_FOUND, with the fix in the message, when
// there is neither.
Expected<std::string> read_head_address(const std::string& root);
void remove_head_address(const std::string& root);

// <root>/cluster_token.
std::string cluster_token_path(const std::string& root);
// Writes `content` to `path` atomically with mode 0600.
Status write_secret_file(const std::string& path, const std::string& content);

// The start time of process `pid` (clock ticks after boot, /proc/<pid>/stat), 0 when it does not
// run (a zombie counts as gone).
uint64_t process_start_time(int pid);
// True while `pid` runs (a zombie waiting to be reaped counts as gone).
bool pid_running(int pid);
// True while `pid` runs and is the process that started at `start_time` (not a reused pid).
bool same_process(int pid, uint64_t start_time);
// The command line of a running process, arguments joined by spaces ("" when gone).
std::string process_command_line(int pid);
// The program a running process executes (/proc/<pid>/exe, without the " (deleted)" the link
// gets once the file was replaced, by a rebuild say); "" when it is gone or not this user's.
std::string process_executable(int pid);
// Whether `record` still names a running daemon before anything signals it: the pid runs, it
// started at the recorded start time (so it is not a reused pid) and it runs the recorded
// program (a record without one: a program named `tessera`). When not, `why` (if given) says
// what runs there instead.
bool daemon_still_running(const DaemonRecord& record, std::string* why = nullptr);

// The prefix of every shared-memory segment this process creates: "/tessera-<pid>-<start>-".
std::string shm_prefix_for_this_process();

// What cleanup_stale() removed, one human line per item.
struct CleanupReport {
  size_t segments = 0;
  uint64_t segment_bytes = 0;
  size_t sessions = 0;
  size_t local_dirs = 0;
  std::vector<std::string> lines;
};

// Removes what processes that died without cleaning up left behind, and only that:
// /dev/shm/tessera-<pid>-<start>-* segments of this user whose daemon no longer runs, session
// folders under `root` whose daemon no longer runs (the newest of them is kept, for its logs),
// and local-* folders whose driver no longer runs and that hold no running daemon.
CleanupReport cleanup_stale(const std::string& root, const std::string& shm_dir = "/dev/shm");

// A fresh <root>/local-XXXXXX folder owned by this process, for an embedded local node.
Expected<std::string> create_local_dir(const std::string& root);

// The first non-loopback IPv4 address of an interface that is up, else "127.0.0.1".
std::string detect_node_ip();

// True when `host` is a loopback address ("127.x.x.x", "::1", "localhost").
bool is_loopback_host(const std::string& host);

// Unix time in milliseconds.
uint64_t unix_ms();

}  // namespace tessera
