#include "daemon/start.h"

#include <fcntl.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/wait.h>
#include <unistd.h>

#include <kj/async-unix.h>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <thread>

#include "common/logging.h"
#include "daemon/actor_supervisor.h"
#include "daemon/daemon.h"
#include "daemon/session.h"

namespace tessera {

namespace {

void report(int fd, const std::string& line) {
  if (fd < 0) return;
  std::string out = line + "\n";
  ssize_t ignored = ::write(fd, out.data(), out.size());
  (void)ignored;
}

// Runs the daemon in this process until it is stopped. `report_fd` (or -1) receives
// "OK <address>" once it serves, or "ERR <message>" if it cannot start.
int run_daemon(const StartOptions& o, const std::string& root, const std::string& session_dir,
               int report_fd) {
  DaemonConfig c;
  c.head = o.head;
  c.node_id = random_id("n-", 10);
  c.head_address = o.address;
  c.bind_host = o.bind_host;
  c.port = static_cast<uint16_t>(o.port >= 0 ? o.port : (o.head ? 6380 : 0));
  c.node_ip = o.node_ip;
  c.node_name = o.node_name;
  c.session_dir = session_dir;
  c.bin_dir = o.bin_dir;
  c.object_store_bytes = o.object_store_memory;
  c.heartbeat_ms = o.heartbeat_ms;
  c.missed_beats = o.missed_beats;
  c.nvml_library = o.nvml_library;

  std::string log_file = session_dir + "/logs/daemon-" + c.node_id + ".log";
  Status st = init_logging({"daemon", o.block ? "" : log_file, o.log_level});
  if (!st) {
    report(report_fd, "ERR " + st.message());
    std::cerr << "tessera start: " << st.message() << "\n";
    return 2;
  }
  kj::UnixEventPort::captureSignal(SIGTERM);
  kj::UnixEventPort::captureSignal(SIGINT);
  kj::UnixEventPort::captureChildExit();
  ::signal(SIGPIPE, SIG_IGN);

  auto io = kj::setupAsyncIo();
  auto daemon = Daemon::start(io, c);
  if (!daemon) {
    spdlog::error("cannot start: {}", daemon.status().message());
    report(report_fd, "ERR " + daemon.status().message());
    if (o.block) std::cerr << "tessera start: " << daemon.status().message() << "\n";
    return 1;
  }
  DaemonRecord rec;
  rec.pid = ::getpid();
  rec.address = (*daemon)->address();
  rec.role = o.head ? "head" : "node";
  rec.node_id = (*daemon)->node_id();
  rec.session_dir = session_dir;
  rec.head_address = o.head ? rec.address : o.address;
  if (Status w = write_daemon_record(root, rec); !w) spdlog::warn("{}", w.message());
  if (o.head) {
    if (Status w = write_head_address(root, rec.address); !w) spdlog::warn("{}", w.message());
  }
  report(report_fd, "OK " + rec.address + " " + rec.node_id);
  if (report_fd >= 0) ::close(report_fd);
  if (o.block) {
    std::cerr << "tessera: " << rec.role << " " << rec.node_id << " serving at " << rec.address
              << " (Ctrl-C to stop)\n";
  }

  (*daemon)->run().wait(io.waitScope);
  daemon->reset();
  remove_daemon_record(root, rec.pid);
  spdlog::info("stopped");
  return 0;
}

}  // namespace

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
  std::string root = temp_root(o.temp_dir);
  auto session = create_session_dir(root);
  if (!session) {
    std::cerr << "tessera start: " << session.status().message() << "\n";
    return 1;
  }
  if (o.block) return run_daemon(o, root, *session, -1);

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
    int null_fd = ::open("/dev/null", O_RDWR);
    std::string crash_log = *session + "/logs/daemon-stderr.log";
    int err_fd = ::open(crash_log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (null_fd >= 0) {
      ::dup2(null_fd, 0);
      ::dup2(null_fd, 1);
    }
    if (err_fd >= 0) ::dup2(err_fd, 2);
    _exit(run_daemon(o, root, *session, pipefd[1]));
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
    std::string rest = reply.substr(3, reply.find('\n') - 3);
    std::string address = rest.substr(0, rest.find(' '));
    std::string node_id = rest.substr(rest.find(' ') + 1);
    if (o.head) {
      std::cout << "Started the head node " << node_id << " at " << address << " (pid " << pid
                << ").\n"
                << "  logs:        " << *session << "/logs/\n"
                << "  add a node:  tessera start --address " << address << "\n"
                << "  see it:      tessera status\n"
                << "  stop it:     tessera stop\n";
    } else {
      std::cout << "Started node " << node_id << " at " << address << " (pid " << pid
                << "), member of the cluster at " << o.address << ".\n"
                << "  logs: " << *session << "/logs/\n";
    }
    return 0;
  }
  std::string message = reply.rfind("ERR ", 0) == 0 ? reply.substr(4) : reply;
  while (!message.empty() && message.back() == '\n') message.pop_back();
  if (message.empty()) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    message = "the daemon exited during start-up; see " + *session + "/logs/";
  }
  std::cerr << "tessera start: " << message << "\n";
  return 1;
}

int stop_command(const StopOptions& o) {
  std::string root = temp_root(o.temp_dir);
  auto records = read_daemon_records(root);
  if (records.empty()) {
    std::cout << "No Tessera daemons are running from " << root << ".\n";
    return 0;
  }
  // Members first, so the head sees them leave; the head last.
  std::stable_sort(records.begin(), records.end(),
                   [](const DaemonRecord& a, const DaemonRecord& b) {
                     return a.role != "head" && b.role == "head";
                   });
  int failures = 0;
  for (const auto& r : records) {
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
      if (!pid_running(r.pid)) {
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
    remove_daemon_record(root, r.pid);
    if (r.role == "head") {
      std::error_code ec;
      std::filesystem::remove(root + "/head_address", ec);
    }
  }
  return failures ? 1 : 0;
}

}  // namespace tessera
