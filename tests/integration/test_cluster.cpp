#include "tests/integration/test_cluster.h"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>
#include <utility>

namespace tessera::testing {

namespace fs = std::filesystem;

CommandResult run_command(const std::vector<std::string>& argv, std::chrono::milliseconds timeout,
                          const std::vector<std::string>& env, int max_fds) {
  CommandResult r;
  int out_pipe[2], err_pipe[2];
  if (::pipe2(out_pipe, O_CLOEXEC) != 0 || ::pipe2(err_pipe, O_CLOEXEC) != 0) return r;
  pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(out_pipe[1], 1);
    ::dup2(err_pipe[1], 2);
    for (const auto& e : env) ::putenv(const_cast<char*>(e.c_str()));
    if (max_fds > 0) {
      rlimit limit{static_cast<rlim_t>(max_fds), static_cast<rlim_t>(max_fds)};
      ::setrlimit(RLIMIT_NOFILE, &limit);
    }
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    _exit(127);
  }
  ::close(out_pipe[1]);
  ::close(err_pipe[1]);
  auto deadline = std::chrono::steady_clock::now() + timeout;
  pollfd fds[2] = {{out_pipe[0], POLLIN, 0}, {err_pipe[0], POLLIN, 0}};
  int open_fds = 2;
  char buf[4096];
  while (open_fds > 0) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      r.timed_out = true;
      ::kill(pid, SIGKILL);
      break;
    }
    int n = ::poll(fds, 2, static_cast<int>(left.count()));
    if (n < 0 && errno == EINTR) continue;
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || !(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      ssize_t got = ::read(fds[i].fd, buf, sizeof(buf));
      if (got <= 0) {
        ::close(fds[i].fd);
        fds[i].fd = -1;
        --open_fds;
      } else {
        (i == 0 ? r.out : r.err).append(buf, static_cast<size_t>(got));
      }
    }
  }
  for (auto& f : fds) {
    if (f.fd >= 0) ::close(f.fd);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

std::string bin(const std::string& name) {
  const char* dir = std::getenv("TESSERA_BIN_DIR");
  return std::string(dir != nullptr ? dir : "build/bin") + "/" + name;
}

bool wait_until(const std::function<bool()>& pred, std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    if (pred()) return true;
    if (std::chrono::steady_clock::now() >= deadline) return pred();
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

namespace {
// A /proc file's text, "" when it cannot be read: the process may exit between listing /proc and
// reading it (ESRCH), which std::ifstream turns into an exception.
std::string read_proc_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return {};
  std::string text;
  char buf[4096];
  for (ssize_t n; (n = ::read(fd, buf, sizeof(buf))) > 0;) text.append(buf, static_cast<size_t>(n));
  ::close(fd);
  return text;
}
}  // namespace

bool process_alive(int pid) {
  if (pid <= 0) return false;
  if (::kill(pid, 0) != 0) return false;
  // A zombie is not alive: check /proc state.
  const std::string content = read_proc_file("/proc/" + std::to_string(pid) + "/stat");
  auto close_paren = content.rfind(')');
  if (close_paren != std::string::npos && close_paren + 2 < content.size()) {
    return content[close_paren + 2] != 'Z';
  }
  return true;
}

BackgroundProcess::BackgroundProcess(const std::vector<std::string>& argv,
                                     const std::vector<std::string>& env) {
  char tmpl[] = "/tmp/tessera-bg-XXXXXX";
  int fd = ::mkstemp(tmpl);
  ::close(fd);
  out_path_ = std::string(tmpl) + ".out";
  err_path_ = std::string(tmpl) + ".err";
  ::unlink(tmpl);
  pid_ = ::fork();
  if (pid_ == 0) {
    ::setpgid(0, 0);
    int out = ::open(out_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    int err = ::open(err_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    ::dup2(out, 1);
    ::dup2(err, 2);
    for (const auto& e : env) ::putenv(const_cast<char*>(e.c_str()));
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    _exit(127);
  }
  ::setpgid(pid_, pid_);  // no race with the child's own call: both set the same group
}

BackgroundProcess::~BackgroundProcess() {
  if (!reaped_ && pid_ > 0) {
    ::kill(-pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }
  ::unlink(out_path_.c_str());
  ::unlink(err_path_.c_str());
}

int BackgroundProcess::wait(std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  while (true) {
    pid_t r = ::waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      reaped_ = true;
      return status;
    }
    if (std::chrono::steady_clock::now() > deadline) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

std::string BackgroundProcess::out() const {
  std::ifstream in(out_path_);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::string BackgroundProcess::err() const {
  std::ifstream in(err_path_);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::string cmdline_of(int pid) {
  std::string cmd = read_proc_file("/proc/" + std::to_string(pid) + "/cmdline");
  std::replace(cmd.begin(), cmd.end(), '\0', ' ');
  return cmd;
}

std::vector<int> processes_matching(const std::string& needle) {
  std::vector<int> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/proc", ec)) {
    std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    int pid = std::atoi(name.c_str());
    const std::string cmd = cmdline_of(pid);
    if (cmd.find(needle) != std::string::npos && pid != ::getpid() && process_alive(pid)) {
      out.push_back(pid);
    }
  }
  return out;
}

std::vector<int> children_of(int parent) {
  std::vector<int> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/proc", ec)) {
    std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::string stat = read_proc_file((e.path() / "stat").string());
    auto paren = stat.rfind(')');
    if (paren == std::string::npos) continue;
    std::istringstream fields(stat.substr(paren + 2));
    std::string state;
    int ppid = 0;
    fields >> state >> ppid;
    if (ppid == parent && state != "Z") out.push_back(std::atoi(name.c_str()));
  }
  return out;
}

std::string read_logs(const std::string& dir, const std::string& prefix) {
  std::string all;
  std::error_code ec;
  for (const auto& e : fs::recursive_directory_iterator(dir, ec)) {
    if (!e.is_regular_file() || e.path().filename().string().rfind(prefix, 0) != 0) continue;
    std::ifstream in(e.path());
    all += std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }
  return all;
}

TestCluster::TestCluster() {
  char tmpl[] = "/tmp/tessera-test-XXXXXX";
  root_ = ::mkdtemp(tmpl);
}

TestCluster::~TestCluster() {
  tessera({"stop", "--temp-dir", root_, "--timeout", "5"});
  // Anything the records missed (a daemon we SIGSTOPped and never resumed, say).
  std::error_code ec;
  fs::remove_all(root_, ec);
}

CommandResult TestCluster::tessera(std::vector<std::string> args, std::chrono::milliseconds timeout,
                                   const std::vector<std::string>& env, int max_fds) {
  args.insert(args.begin(), bin("tessera"));
  last_ = run_command(args, timeout, env, max_fds);
  return last_;
}

std::string TestCluster::token() const {
  std::ifstream in(root_ + "/cluster_token");
  std::string token;
  std::getline(in, token);
  return token;
}

std::string TestCluster::start_head(const std::vector<std::string>& extra) {
  std::vector<std::string> args = {"start", "--head", "--port", "0", "--temp-dir", root_};
  // Fast heartbeats (a member is dead after 500 ms of silence), unless the test sets its own.
  for (const auto& [flag, value] : {std::pair<const char*, const char*>{"--heartbeat-ms", "100"},
                                    {"--missed-heartbeats", "5"}}) {
    if (std::find(extra.begin(), extra.end(), flag) == extra.end()) {
      args.insert(args.end(), {flag, value});
    }
  }
  args.insert(args.end(), extra.begin(), extra.end());
  // This root is also the daemons' default root, so `start` records nothing in the real one
  // (the current_root pointer `tessera status` follows).
  auto r = tessera(args, std::chrono::seconds(60), {"TESSERA_TMPDIR=" + root_});
  if (r.exit_code != 0) return "";
  std::ifstream in(root_ + "/head_address");
  std::getline(in, head_address_);
  return head_address_;
}

std::string TestCluster::start_member(const std::string& name,
                                      const std::vector<std::string>& extra) {
  std::vector<std::string> args = {"start", "--address",   head_address_, "--temp-dir",
                                   root_,   "--node-name", name};
  args.insert(args.end(), extra.begin(), extra.end());
  auto r = tessera(args, std::chrono::seconds(60), {"TESSERA_TMPDIR=" + root_});
  if (r.exit_code != 0) return "";
  // "Started node n-xxxx at ..."
  auto pos = r.out.find("Started node ");
  if (pos == std::string::npos) return "";
  auto start = pos + std::string("Started node ").size();
  return r.out.substr(start, r.out.find(' ', start) - start);
}

int TestCluster::daemon_pid(const std::string& node_id) const {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root_, ec)) {
    std::ifstream in(e.path() / "daemon.json");
    if (!in) continue;
    auto j = nlohmann::json::parse(in, nullptr, false);
    if (!j.is_discarded() && j.value("node_id", "") == node_id) return j.value("pid", -1);
  }
  return -1;
}

std::string ip_binary() {
  for (const char* p : {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"}) {
    if (::access(p, X_OK) == 0) return p;
  }
  return "ip";
}

namespace {

bool run_ip(std::vector<std::string> args) {
  args.insert(args.begin(), ip_binary());
  return run_command(args, std::chrono::seconds(20)).exit_code == 0;
}

}  // namespace

NetnsHosts::NetnsHosts(size_t hosts) {
  const std::string id = std::to_string(::getpid() % 100000);
  const std::string net = "10.214." + std::to_string(::getpid() % 250 + 1) + ".";
  bridge_ = "tsh-" + id + "-br";
  home_fd_ = ::open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC);
  ok_ = home_fd_ >= 0 && run_ip({"netns", "add", bridge_}) &&
        run_ip({"-n", bridge_, "link", "add", "br0", "type", "bridge"}) &&
        run_ip({"-n", bridge_, "link", "set", "br0", "up"});
  for (size_t i = 0; i < hosts; ++i) {
    names_.push_back("tsh-" + id + "-" + std::to_string(i));
    addrs_.push_back(net + std::to_string(i + 1));
    const std::string host_end = "eth0", bridge_end = "h" + std::to_string(i);
    ok_ = ok_ && run_ip({"netns", "add", names_[i]}) &&
          run_ip({"-n", names_[i], "link", "add", host_end, "type", "veth", "peer", "name",
                  bridge_end, "netns", bridge_}) &&
          run_ip({"-n", bridge_, "link", "set", bridge_end, "master", "br0"}) &&
          run_ip({"-n", bridge_, "link", "set", bridge_end, "up"}) &&
          run_ip({"-n", names_[i], "addr", "add", addrs_[i] + "/24", "dev", host_end}) &&
          run_ip({"-n", names_[i], "link", "set", host_end, "up"}) &&
          run_ip({"-n", names_[i], "link", "set", "lo", "up"});
  }
  if (!ok_) {
    for (size_t i = 0; i < addrs_.size(); ++i) addrs_[i] = "127.0.0.1";
  }
}

NetnsHosts::~NetnsHosts() {
  leave();
  for (const std::string& n : names_) run_ip({"netns", "del", n});
  run_ip({"netns", "del", bridge_});
  if (home_fd_ >= 0) ::close(home_fd_);
}

void NetnsHosts::enter(size_t host) {
  if (!ok_) return;
  const int fd = ::open(("/run/netns/" + names_.at(host)).c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 || ::setns(fd, CLONE_NEWNET) != 0) {
    std::fprintf(stderr, "NetnsHosts: cannot enter %s\n", names_.at(host).c_str());
  }
  if (fd >= 0) ::close(fd);
}

void NetnsHosts::leave() {
  if (home_fd_ >= 0) (void)::setns(home_fd_, CLONE_NEWNET);
}

}  // namespace tessera::testing
