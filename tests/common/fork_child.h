// Test support shared by the shared-memory tests: forked children that report back, and
// segment names that do not collide between parallel test processes.
#pragma once

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <string>

namespace tessera::testing {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// "/tessera-test-<pid>-<what>-<n>": unique per process and call.
inline std::string unique_name(const std::string& what) {
  static std::atomic<int> counter{0};
  return "/tessera-test-" + std::to_string(::getpid()) + "-" + what + "-" +
         std::to_string(counter++);
}

// Runs `body` in a forked child. The child writes body's report (empty = success) to a pipe and
// _exits; the parent waits for the pipe to close, with a timeout, then reaps the child.
class Child {
 public:
  explicit Child(const std::function<std::string()>& body) {
    int fds[2];
    if (::pipe(fds) != 0) std::abort();
    pid_ = ::fork();
    if (pid_ == 0) {
      ::close(fds[0]);
      std::string report = body();
      if (::write(fds[1], report.data(), report.size()) < 0) ::_exit(3);
      ::_exit(0);
    }
    ::close(fds[1]);
    fd_ = fds[0];
  }
  ~Child() {
    if (fd_ >= 0) ::close(fd_);
  }

  // The child's report plus anything wrong with how it ended; empty when all went well.
  std::string wait(std::chrono::milliseconds timeout) {
    std::string report;
    auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      pollfd p{fd_, POLLIN, 0};
      if (left.count() <= 0 || ::poll(&p, 1, static_cast<int>(left.count())) == 0) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, nullptr, 0);
        return report + " [child timed out]";
      }
      char buf[4096];
      ssize_t n = ::read(fd_, buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;  // EOF: the child is done
      report.append(buf, static_cast<size_t>(n));
    }
    int status = 0;
    ::waitpid(pid_, &status, 0);
    last_status_ = status;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) report += " [child died abnormally]";
    return report;
  }
  int last_status() const { return last_status_; }

 private:
  pid_t pid_ = -1;
  int fd_ = -1;
  int last_status_ = 0;
};

}  // namespace tessera::testing
