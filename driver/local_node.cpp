#include "driver/local_node.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>
#include <vector>

#include "common/session.h"
#include "protocol/auth.h"

namespace tessera {

namespace {

std::string self_exe() {
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : "tessera";
}

}  // namespace

Expected<std::unique_ptr<LocalNode>> LocalNode::start(const std::string& tessera_binary) {
  std::string binary = tessera_binary;
  if (binary.empty()) {
    // The `tessera` program: this one, or the one beside it (a program on the driver library).
    const std::string self = self_exe();
    const size_t slash = self.rfind('/');
    const std::string name = slash == std::string::npos ? self : self.substr(slash + 1);
    binary = name == "tessera" ? self : self.substr(0, slash + 1) + "tessera";
    if (::access(binary.c_str(), X_OK) != 0) {
      return failed_precondition("cannot start a local node: no tessera program at " + binary +
                                 " (install it beside " + name + ", or give --address)");
    }
  }
  TESSERA_ASSIGN_OR_RETURN(std::string user_root, open_root(""));
  cleanup_stale(user_root);  // what SIGKILLed commands left behind
  std::unique_ptr<LocalNode> node(new LocalNode());
  TESSERA_ASSIGN_OR_RETURN(node->root_, create_local_dir(user_root));
  std::string log = node->root_ + "/daemon.out";
  pid_t parent = ::getpid();
  pid_t pid = ::fork();
  if (pid < 0) return unavailable("cannot fork a local node");
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != parent) _exit(1);
    int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
    if (fd >= 0) {
      ::dup2(fd, 1);
      ::dup2(fd, 2);
    }
    std::vector<std::string> args = {binary,      "start",     "--head",     "--block",
                                     "--port",    "0",         "--temp-dir", node->root_,
                                     "--node-ip", "127.0.0.1", "--ephemeral"};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(binary.c_str(), argv.data());
    _exit(127);
  }
  node->pid_ = pid;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (std::chrono::steady_clock::now() < deadline) {
    std::ifstream in(node->root_ + "/head_address");
    if (in && std::getline(in, node->address_) && !node->address_.empty()) {
      // The head wrote its token before it started serving.
      TESSERA_ASSIGN_OR_RETURN(node->token_,
                               auth::read_token_file(cluster_token_path(node->root_)));
      return node;
    }
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      node->pid_ = -1;
      std::ifstream err(log);
      std::string text((std::istreambuf_iterator<char>(err)), std::istreambuf_iterator<char>());
      return unavailable("the local node exited during start-up: " + text);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return deadline_exceeded("the local node did not start within 20 s; see " + log);
}

LocalNode::~LocalNode() {
  bool clean_exit = false;
  if (pid_ > 0) {
    ::kill(pid_, SIGTERM);
    int status = 0;
    for (int i = 0; i < 500; ++i) {
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        clean_exit = WIFEXITED(status);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, &status, 0);
    }
  }
  std::error_code ec;
  std::filesystem::remove_all(root_, ec);
  if (!clean_exit) {
    // A daemon that was killed left its shared-memory segments: they go now, not at the next
    // start on this machine.
    cleanup_stale(std::filesystem::path(root_).parent_path().string());
  }
}

}  // namespace tessera
