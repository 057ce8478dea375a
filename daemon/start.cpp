#include "daemon/start.h"

#include <fcntl.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <kj/async-unix.h>
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

#include "common/logging.h"
#include "common/session.h"
#include "daemon/actor_supervisor.h"
#include "daemon/daemon.h"
#include "driver/cli/cli_help.h"
#include "protocol/auth.h"
#include "protocol/cluster.capnp.h"
#include "protocol/rpc.h"

namespace tessera {

namespace {

void report(int fd, const std::string& line) {
  if (fd < 0) return;
  std::string out = line + "\n";
  ssize_t ignored = ::write(fd, out.data(), out.size());
  (void)ignored;
}

// What the daemon tells the waiting `tessera start` once it serves.
struct Started {
  std::string address;
  std::string node_id;
  std::string session_dir;
  std::string bind_address;
};

std::string encode(const Started& s) {
  return "OK " + s.address + " " + s.node_id + " " + s.bind_address + " " + s.session_dir;
}

Started decode(const std::string& line) {
  Started s;
  std::istringstream in(line.substr(3));
  in >> s.address >> s.node_id >> s.bind_address;
  std::getline(in >> std::ws, s.session_dir);
  return s;
}

// <root>/start.lock, held (flock) from the checks of `tessera start` until its daemon has
// written its record, so two starts from one root cannot both pass the checks. A forked daemon
// shares the lock with its `tessera start`; each lets go of its own descriptor.
class StartLock {
 public:
  StartLock() = default;
  StartLock(const StartLock&) = delete;
  StartLock& operator=(const StartLock&) = delete;
  ~StartLock() { release(); }

  Status acquire(const std::string& root) {
    const std::string path = root + "/start.lock";
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd_ < 0) return unavailable("cannot open " + path + ": " + std::strerror(errno));
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      if (errno != EWOULDBLOCK && errno != EINTR) {
        return unavailable("cannot lock " + path + ": " + std::strerror(errno));
      }
      if (std::chrono::steady_clock::now() > deadline) {
        return unavailable("another `tessera start` from " + root +
                           " has been starting for 60 s (it holds " + path +
                           "); wait for it or stop it");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return Status::ok();
  }
  void release() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

std::string read_first_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

// Runs the daemon in this process until it is stopped. `report_fd` (or -1) receives
// "OK <address> <node> <bind> <session>" once it serves, or "ERR <message>" if it cannot start.
// `lock` is released once the daemon's record is written (or it failed to start).
int run_daemon(const StartOptions& o, const std::string& root, const std::string& token,
               int report_fd, StartLock& lock) {
  auto fail = [&](const std::string& message, int code) {
    report(report_fd, "ERR " + message);
    if (report_fd < 0) std::cerr << "tessera start: " << message << "\n";
    return code;
  };
  auto session_dir = create_session_dir(root);
  if (!session_dir) return fail(session_dir.status().message(), 1);
  DaemonConfig c;
  c.head = o.head;
  c.node_id = random_id("n-", 10);
  c.head_address = o.address;
  c.cluster_token = token;
  c.bind_host = o.bind_host;
  c.port = static_cast<uint16_t>(o.port >= 0 ? o.port : (o.head ? 6380 : 0));
  c.node_ip = o.node_ip;
  c.node_name = o.node_name;
  c.session_dir = *session_dir;
  c.bin_dir = o.bin_dir;
  c.object_store_bytes = o.object_store_memory;
  c.shm_per_lease_bytes = o.shm_per_lease;
  c.heartbeat_ms = o.heartbeat_ms;
  c.missed_beats = o.missed_beats;
  c.max_actors = o.max_actors;
  c.actor_health_timeout_ms = static_cast<uint32_t>(o.actor_health_timeout_s * 1000.0);
  c.actor_step_timeout_ms = static_cast<uint32_t>(o.actor_step_timeout_s * 1000.0);
  c.actor_env_allow = o.actor_env_allow;
  c.limits.max_connections = o.max_connections;
  c.limits.max_message_bytes = uint64_t{o.max_message_mib} << 20;
  c.limits.max_inflight_bytes = 4 * c.limits.max_message_bytes;
  c.nvml_library = o.nvml_library;
  if (o.gpus.has_value()) {
    c.gpus = o.gpus;
  } else if (const char* visible = std::getenv("CUDA_VISIBLE_DEVICES"); visible != nullptr) {
    c.gpus = std::string(visible);
    c.gpus_exact = false;
  }

  std::string log_file = *session_dir + "/logs/daemon-" + c.node_id + ".log";
  Status st = init_logging({"daemon", o.block ? "" : log_file, o.log_level});
  if (!st) return fail(st.message(), 2);
  kj::UnixEventPort::captureSignal(SIGTERM);
  kj::UnixEventPort::captureSignal(SIGINT);
  kj::UnixEventPort::captureChildExit();
  ::signal(SIGPIPE, SIG_IGN);

  int code = 0;
  bool served = false;
  {
    auto io = kj::setupAsyncIo();
    auto daemon = Daemon::start(io, c);
    if (!daemon) {
      spdlog::error("cannot start: {}", daemon.status().message());
      code = fail(daemon.status().message(), 1);
    } else {
      DaemonRecord rec;
      rec.pid = ::getpid();
      rec.start_time = process_start_time(rec.pid);
      rec.address = (*daemon)->address();
      rec.role = o.head ? "head" : "node";
      rec.node_id = (*daemon)->node_id();
      rec.session_dir = *session_dir;
      rec.head_address = o.head ? rec.address : o.address;
      rec.executable = process_executable(rec.pid);
      if (Status w = write_daemon_record(rec); !w) spdlog::warn("{}", w.message());
      if (o.head) {
        if (Status w = write_head_address(root, rec.address); !w) spdlog::warn("{}", w.message());
      }
      lock.release();
      report(report_fd,
             encode({rec.address, rec.node_id, *session_dir, (*daemon)->bind_address()}));
      if (report_fd >= 0) ::close(report_fd);
      if (o.block) {
        std::cerr << "tessera: " << rec.role << " " << rec.node_id << " serving at " << rec.address
                  << " (Ctrl-C to stop)\n";
      }
      served = true;
      (*daemon)->run().wait(io.waitScope);
      daemon->reset();
      remove_daemon_record(rec);
      // However it was stopped (SIGTERM, `tessera stop --all`), the root no longer names it.
      if (o.head && read_first_line(root + "/head_address") == rec.address) {
        remove_head_address(root);
      }
      spdlog::info("stopped");
    }
  }
  if (o.ephemeral && served) {
    std::error_code ec;
    std::filesystem::remove_all(root, ec);
  }
  return code;
}

// The token a new daemon uses: a member's from the flag, the environment or this machine's temp
// root; a head's from the flag or the environment, else a fresh one.
Expected<std::string> daemon_token(const StartOptions& o, const std::string& root, bool* fresh) {
  *fresh = false;
  if (o.head) {
    if (!o.cluster_token_file.empty()) return auth::read_token_file(o.cluster_token_file);
    const char* env = std::getenv(auth::kTokenEnv);
    if (env != nullptr && *env != '\0') {
      return auth::check_secret(env, std::string("$") + auth::kTokenEnv);
    }
    *fresh = true;
    return auth::make_secret();
  }
  return auth::resolve_cluster_token(o.cluster_token_file, root);
}

}  // namespace

CLI::App* add_start_subcommand(CLI::App& app, StartOptions& start) {
  auto* start_cmd = app.add_subcommand("start", "Start a node daemon on this machine");
  start_cmd->add_flag("--head", start.head, "Start a new cluster with this node as its head");
  start_cmd->add_option("--address", start.address, "Join the cluster whose head is HOST:PORT");
  start_cmd->add_option("--port", start.port, "RPC port (head default 6380, members any free)")
      ->check(CLI::Range(0, 65535));
  start_cmd->add_flag("--block", start.block, "Stay in the foreground and log to stderr");
  start_cmd->add_option("--temp-dir", start.temp_dir,
                        "Root for session logs and records (default $TESSERA_TMPDIR or "
                        "/tmp/tessera)");
  start_cmd->add_option("--cluster-token-file", start.cluster_token_file,
                        "The cluster token (head: instead of a new one; members: the head's)");
  start_cmd->add_option("--node-ip,--host", start.node_ip,
                        "Address to listen on and advertise (default: loopback for a head, the "
                        "address that reaches the head for a member)");
  start_cmd->add_option("--node-name", start.node_name, "Name shown in status (default hostname)");
  start_cmd->add_option("--bind", start.bind_host,
                        "Listen here instead of --node-ip (e.g. 0.0.0.0), still advertising "
                        "--node-ip");
  start_cmd
      ->add_option("--object-store-memory", start.object_store_memory,
                   "Bytes of shared memory for objects and rings (default " +
                       std::to_string(node_defaults::kObjectStoreBytes >> 30) + " GiB)")
      ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 50));
  start_cmd->add_option("--shm-per-lease", start.shm_per_lease,
                        "Bytes of shared memory one lease may hold (default: all of it)");
  start_cmd
      ->add_option("--max-connections", start.max_connections,
                   "RPC connections open at once (default 512)")
      ->check(CLI::Range(1u, 1000000u));
  start_cmd
      ->add_option("--max-message-mib", start.max_message_mib,
                   "Largest RPC message a peer may send, MiB (default 64)")
      ->check(CLI::Range(1u, 4096u));
  start_cmd->add_option("--max-actors", start.max_actors, "Actors alive at once")
      ->capture_default_str()
      ->check(CLI::Range(1u, 100000u));
  start_cmd
      ->add_option("--actor-health-timeout", start.actor_health_timeout_s,
                   "Seconds without a heartbeat before an actor is killed as hung (0 = off)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 86400.0));
  start_cmd
      ->add_option("--actor-step-timeout", start.actor_step_timeout_s,
                   "Seconds a step may go without progress before the actor counts as "
                   "stuck (0 = off)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 86400.0));
  start_cmd->add_option("--actor-env-allow", start.actor_env_allow,
                        "More environment variables a driver may set on actors (NAME or "
                        "PREFIX_*; repeatable)");
  start_cmd->add_flag("--ephemeral", start.ephemeral)->group("");  // embedded local nodes
  start_cmd->add_option("--heartbeat-ms", start.heartbeat_ms, "Heartbeat period")
      ->capture_default_str()
      ->check(CLI::Range(10u, 600000u));
  start_cmd
      ->add_option("--missed-heartbeats", start.missed_beats, "Missed beats before a node is dead")
      ->capture_default_str()
      ->check(CLI::Range(1u, 1000u));
  start_cmd->add_option("--nvml-library", start.nvml_library,
                        "Path of libnvidia-ml.so.1 (default: the system's)");
  start_cmd->add_option("--gpus", start.gpus,
                        "GPUs this node offers: NVML indices (nvidia-smi's numbers) or UUIDs, "
                        "comma-separated (default: $CUDA_VISIBLE_DEVICES when set, else all)");
  start_cmd->add_option("--actor-bin-dir", start.bin_dir,
                        "Where tessera-actor lives (default: next to tessera)");
  add_examples(start_cmd, {"tessera start --head",
                           "tessera start --address 10.0.0.1:6380 "
                           "--cluster-token-file ./cluster_token"});
  return start_cmd;
}

int start_command(const StartOptions& o) {
  if (o.head == !o.address.empty()) {
    std::cerr << "tessera start: pass exactly one of --head (start a cluster) or --address "
                 "HEAD:PORT (join one)\n";
    return 2;
  }
  if (o.port > 65535) {
    std::cerr << "tessera start: --port " << o.port << " is not a TCP port\n";
    return 2;
  }
  if (o.object_store_memory == 0) {
    std::cerr << "tessera start: --object-store-memory must be more than 0 bytes\n";
    return 2;
  }
  if (o.max_connections == 0 || o.max_message_mib == 0 || o.max_actors == 0) {
    std::cerr << "tessera start: --max-connections, --max-message-mib and --max-actors must be "
                 "at least 1\n";
    return 2;
  }
  if (!(o.actor_health_timeout_s >= 0) || !(o.actor_step_timeout_s >= 0)) {
    std::cerr << "tessera start: --actor-health-timeout and --actor-step-timeout are seconds "
                 ">= 0 (0 turns the check off)\n";
    return 2;
  }
  auto root = open_root(o.temp_dir);
  if (!root) {
    std::cerr << "tessera start: " << root.status().message() << "\n";
    return 1;
  }
  StartLock lock;
  if (Status st = lock.acquire(*root); !st) {
    std::cerr << "tessera start: " << st.message() << "\n";
    return 1;
  }
  CleanupReport cleaned = cleanup_stale(*root);
  for (const auto& line : cleaned.lines) std::cout << "Cleaned up: " << line << ".\n";
  if (o.head) {
    // A second head from this root would take over its cluster_token and head_address, and no
    // one could reach the first one any more.
    for (const DaemonRecord& r : read_daemon_records(*root)) {
      if (r.role != "head" || !daemon_still_running(r)) continue;
      std::string temp_flag = o.temp_dir.empty() ? "" : " --temp-dir " + o.temp_dir;
      std::cerr << "tessera start: a head is already running from " << *root << " at " << r.address
                << " (pid " << r.pid << "); `tessera stop" << temp_flag
                << "` first, or start another cluster with --temp-dir DIR\n";
      return 1;
    }
  }

  bool fresh = false;
  auto token = daemon_token(o, *root, &fresh);
  if (!token) {
    std::cerr << "tessera start: " << token.status().message() << "\n";
    return 1;
  }
  const std::string token_path = cluster_token_path(*root);
  if (o.head || !std::filesystem::exists(token_path)) {
    if (Status w = write_secret_file(token_path, *token); !w) {
      std::cerr << "tessera start: " << w.message() << "\n";
      return 1;
    }
  }
  if (o.block) return run_daemon(o, *root, *token, -1, lock);

  int pipefd[2];
  if (::pipe2(pipefd, O_CLOEXEC) != 0) {
    std::perror("tessera start: pipe");
    return 1;
  }
  pid_t pid = ::fork();
  if (pid < 0) {
    std::perror("tessera start: fork");
    return 1;
  }
  if (pid == 0) {
    ::close(pipefd[0]);
    ::setsid();
    // The originals are close-on-exec and closed; only the copies on 0, 1 and 2 stay.
    int null_fd = ::open("/dev/null", O_RDWR | O_CLOEXEC);
    std::string crash_log = *root + "/daemon-stderr.log";
    int err_fd = ::open(crash_log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
    if (null_fd >= 0) {
      ::dup2(null_fd, 0);
      ::dup2(null_fd, 1);
      if (null_fd > 2) ::close(null_fd);
    }
    if (err_fd >= 0) {
      ::dup2(err_fd, 2);
      if (err_fd > 2) ::close(err_fd);
    }
    _exit(run_daemon(o, *root, *token, pipefd[1], lock));
  }
  ::close(pipefd[1]);
  std::string reply;
  char buf[4096];
  ssize_t n;
  while ((n = ::read(pipefd[0], buf, sizeof(buf))) != 0) {
    if (n < 0) {
      if (errno == EINTR) continue;
      break;
    }
    reply.append(buf, static_cast<size_t>(n));
    if (reply.find('\n') != std::string::npos) break;
  }
  ::close(pipefd[0]);
  if (reply.rfind("OK ", 0) == 0) {
    Started s = decode(reply.substr(0, reply.find('\n')));
    // `tessera status` / `stop` / `topo` without --temp-dir find this cluster from now on.
    if (!o.ephemeral) {
      if (Status w = record_current_root(*root); !w) spdlog::warn("{}", w.message());
    }
    std::string temp_flag = o.temp_dir.empty() ? "" : " --temp-dir " + o.temp_dir;
    auto host = s.bind_address.substr(0, s.bind_address.rfind(':'));
    std::string reach =
        is_loopback_host(host)
            ? "loopback only; pass --node-ip ADDRESS to let other machines join"
            : (host == "0.0.0.0" || host == "[::]" ? "all interfaces" : "interface " + host);
    if (o.head) {
      std::cout << "Started the head node " << s.node_id << " at " << s.address << " (pid " << pid
                << "), listening on " << reach << ".\n"
                << "  cluster token: " << token_path << (fresh ? " (new)" : "")
                << "\n     other machines pass a copy of it as --cluster-token-file PATH, or its "
                   "text in TESSERA_CLUSTER_TOKEN\n"
                << "  logs:        " << s.session_dir << "/logs/\n"
                << "  add a node:  tessera start --address " << s.address
                << " --cluster-token-file PATH\n"
                << "  see it:      tessera status" << temp_flag << "\n"
                << "  use it:      export TESSERA_ADDRESS=" << s.address
                << "   (then generate, bench and serve run on this cluster)\n"
                << "  stop it:     tessera stop" << temp_flag << "\n";
    } else {
      std::cout << "Started node " << s.node_id << " at " << s.address << " (pid " << pid
                << "), member of the cluster at " << o.address << ", listening on " << reach
                << ".\n"
                << "  logs: " << s.session_dir << "/logs/\n";
    }
    return 0;
  }
  std::string message = reply.rfind("ERR ", 0) == 0 ? reply.substr(4) : reply;
  while (!message.empty() && message.back() == '\n') message.pop_back();
  if (message.empty()) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    message = "the daemon exited during start-up; see " + *root + "/daemon-stderr.log";
  }
  std::cerr << "tessera start: " << message << "\n";
  return 1;
}

CLI::App* add_stop_subcommand(CLI::App& app, StopOptions& stop) {
  auto* stop_cmd = app.add_subcommand(
      "stop", "Stop the daemons started on this machine (--all: every node of the cluster)");
  stop_cmd->add_option("--temp-dir", stop.temp_dir, "The root they were started with");
  stop_cmd->add_option("--timeout", stop.timeout_s, "Seconds before SIGKILL (default 10)");
  stop_cmd->add_flag("--all", stop.all,
                     "Stop every node of the cluster through its head (needs the cluster token)");
  stop_cmd
      ->add_option("--address", stop.address,
                   "With --all: the head HOST:PORT (default: $TESSERA_ADDRESS, else this "
                   "machine's cluster)")
      ->envname("TESSERA_ADDRESS");
  stop_cmd->add_option("--cluster-token-file", stop.cluster_token_file,
                       "With --all: the cluster token (default: $TESSERA_CLUSTER_TOKEN or this "
                       "machine's)");
  add_examples(stop_cmd, {"tessera stop", "tessera stop --all",
                          "tessera stop --all --address 10.0.0.1:6380 --cluster-token-file "
                          "./cluster_token"});
  return stop_cmd;
}

namespace {

std::string node_line(proto::NodeInfo::Reader n) {
  std::string name = n.getName().cStr();
  return std::string(n.getIsHead() ? "head " : "node ") + n.getNodeId().cStr() +
         (name.empty() ? "" : " (" + name + ")") + " at " + n.getAddress().cStr() + " (pid " +
         std::to_string(n.getPid()) + ")";
}

// `tessera stop --all`: Cluster.stopCluster on the head, then waits for the daemons of this
// machine's root that were stopped to exit.
int stop_all(const StopOptions& o) {
  auto root = find_cluster_root(o.temp_dir);
  std::string address = o.address;
  if (address.empty()) {
    auto found = root ? read_head_address(*root) : Expected<std::string>(root.status());
    if (!found) {
      std::cerr << "tessera stop: " << found.status().message() << "\n";
      return 1;
    }
    address = *found;
  }
  auto token = auth::resolve_cluster_token(o.cluster_token_file, root ? *root : std::string());
  if (!token) {
    std::cerr << "tessera stop: " << token.status().message() << "\n";
    return 1;
  }
  ::signal(SIGPIPE, SIG_IGN);
  // This machine's daemons, read before they stop (each removes its record as it exits).
  const std::vector<DaemonRecord> local =
      root ? read_daemon_records(*root) : std::vector<DaemonRecord>();
  std::vector<std::string> stopped_ids;
  std::vector<std::string> missed;
  bool head_stopped = false;
  {
    auto io = kj::setupAsyncIo();
    auto conn = rpc::connect(io, address, "tessera stop --all", *token).wait(io.waitScope);
    if (!conn) {
      std::cerr << "tessera stop: " << conn.status().message() << "\n";
      return 1;
    }
    if (!(*conn)->has_cluster) {
      std::cerr << "tessera stop: " << address << " is a node daemon, not a head; pass the "
                << "head's address (--address HEAD:PORT)\n";
      return 1;
    }
    try {
      auto list = (*conn)->cluster.listNodesRequest();
      list.setIncludeDead(false);
      auto before = list.send().wait(io.waitScope);
      std::vector<std::pair<std::string, std::string>> alive;  // id, line
      for (auto e : before.getNodes()) {
        alive.emplace_back(e.getInfo().getNodeId().cStr(), node_line(e.getInfo()));
      }
      auto req = (*conn)->cluster.stopClusterRequest();
      char host[256] = {0};
      ::gethostname(host, sizeof(host) - 1);
      req.setReason(std::string("tessera stop --all from ") + host);
      auto reply = req.send().wait(io.waitScope);
      for (auto n : reply.getStopped()) {
        std::cout << "Stopped " << node_line(n) << ".\n";
        stopped_ids.emplace_back(n.getNodeId().cStr());
        head_stopped = head_stopped || n.getIsHead();
      }
      for (const auto& [id, line] : alive) {
        if (std::find(stopped_ids.begin(), stopped_ids.end(), id) == stopped_ids.end()) {
          missed.push_back(line);
        }
      }
    } catch (const kj::Exception& e) {
      std::cerr << "tessera stop: " << address << ": " << rpc::to_status(e).message() << "\n";
      return 1;
    }
  }
  for (const auto& line : missed) {
    std::cerr << "tessera stop: could not stop " << line
              << ": it did not answer the head; run `tessera stop` on its machine\n";
  }
  // The daemons of this machine stop on their own; wait for them as `tessera stop` does.
  if (root) {
    for (const auto& r : local) {
      if (std::find(stopped_ids.begin(), stopped_ids.end(), r.node_id) == stopped_ids.end()) {
        continue;
      }
      auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(o.timeout_s);
      while (same_process(r.pid, r.start_time) && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      if (daemon_still_running(r)) {
        ::kill(r.pid, SIGKILL);
        std::cout << "Killed " << r.role << " " << r.node_id << " (pid " << r.pid
                  << ") after it did not stop for " << o.timeout_s << " s.\n";
        remove_daemon_record(r);
        if (r.role == "head") remove_head_address(*root);
      }
    }
  }
  if (!head_stopped) {
    std::cerr << "tessera stop: the head at " << address << " did not say it stopped\n";
    return 1;
  }
  return missed.empty() ? 0 : 1;
}

}  // namespace

int stop_command(const StopOptions& o) {
  if (o.all) return stop_all(o);
  // (--address alone may come from $TESSERA_ADDRESS: without --all it is ignored.)
  if (!o.cluster_token_file.empty()) {
    std::cerr << "tessera stop: --cluster-token-file is for --all (stop the whole cluster); "
                 "without it `tessera stop` stops the daemons started on this machine\n";
    return 2;
  }
  auto root = find_cluster_root(o.temp_dir);
  if (!root) {
    std::cerr << "tessera stop: " << root.status().message() << "\n";
    return 1;
  }
  auto records = read_daemon_records(*root);
  if (records.empty()) {
    std::cout << "No Tessera daemons are running from " << *root << ".\n";
    return 0;
  }
  // Members first, so the head sees them leave; the head last.
  std::stable_sort(records.begin(), records.end(),
                   [](const DaemonRecord& a, const DaemonRecord& b) {
                     return a.role != "head" && b.role == "head";
                   });
  int failures = 0;
  for (const auto& r : records) {
    // Only the process the record names: the same pid, start time and program (a pid that was
    // reused by anything else is never signalled).
    std::string why;
    if (!daemon_still_running(r, &why)) {
      std::cerr << "tessera stop: not signalling pid " << r.pid << ": " << why
                << "; removing its stale record\n";
      remove_daemon_record(r);
      continue;
    }
    if (::kill(r.pid, SIGTERM) != 0) {
      if (errno == ESRCH) continue;
      std::cerr << "tessera stop: cannot signal " << r.role << " " << r.node_id << " (pid " << r.pid
                << "): " << std::strerror(errno) << "\n";
      ++failures;
      continue;
    }
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(o.timeout_s);
    bool gone = false;
    while (std::chrono::steady_clock::now() < deadline) {
      if (!same_process(r.pid, r.start_time)) {
        gone = true;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (!gone) {
      ::kill(r.pid, SIGKILL);
      std::cout << "Killed " << r.role << " " << r.node_id << " (pid " << r.pid
                << ") after it ignored SIGTERM for " << o.timeout_s << " s.\n";
    } else {
      std::cout << "Stopped " << r.role << " " << r.node_id << " at " << r.address << " (pid "
                << r.pid << ").\n";
    }
    remove_daemon_record(r);
    if (r.role == "head") remove_head_address(*root);
  }
  return failures ? 1 : 0;
}

}  // namespace tessera
