// Where a node's daemons keep their files on this machine, and how local commands find them.
//
//   <root>/                         --temp-dir, else $TESSERA_TMPDIR, else /tmp/tessera
//     head_address                  "host:port" of the head started here last (for status/stop)
//     daemons/<pid>.json            one record per running daemon (pid, address, role, ...)
//     session_<date>_<pid>/logs/    daemon-<node>.log, actor-<id>.log
//     session_latest -> session_... the newest session
#pragma once

#include <string>
#include <vector>

#include "common/status.h"

namespace tessera {

// The temp root: `flag` if set, else $TESSERA_TMPDIR, else /tmp/tessera.
std::string temp_root(const std::string& flag);

// Creates <root>/session_<date>_<pid>/logs and points session_latest at it.
Expected<std::string> create_session_dir(const std::string& root);

struct DaemonRecord {
  int pid = 0;
  std::string address;  // "host:port"
  std::string role;     // "head" or "node"
  std::string node_id;
  std::string session_dir;
  std::string head_address;  // the head this daemon joined (equal to address for a head)
};

Status write_daemon_record(const std::string& root, const DaemonRecord& record);
void remove_daemon_record(const std::string& root, int pid);
// Records of daemons still running (stale ones, whose PID is gone, are deleted).
std::vector<DaemonRecord> read_daemon_records(const std::string& root);

Status write_head_address(const std::string& root, const std::string& address);
// NOT_FOUND, with the fix in the message, when no head was started from this root.
Expected<std::string> read_head_address(const std::string& root);

// The first non-loopback IPv4 address of an interface that is up, else "127.0.0.1".
std::string detect_node_ip();

// True while `pid` runs (a zombie waiting to be reaped counts as gone).
bool pid_running(int pid);

// Unix time in milliseconds.
uint64_t unix_ms();

}  // namespace tessera
