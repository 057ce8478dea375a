#include "daemon/process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
#if __has_include(<linux/close_range.h>)
#include <linux/close_range.h>  // CLOSE_RANGE_CLOEXEC
#endif

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

extern char** environ;

namespace tessera {

namespace {

// Marks every descriptor from `first` up close-on-exec, so the child keeps only the ones it is
// given: whatever else the daemon holds (its listening socket, its clients' connections, its
// log, a descriptor it inherited without close-on-exec) stays out of the actor.
// Async-signal-safe: system calls only, no allocation.
void cloexec_from(int first) {
#if defined(SYS_close_range) && defined(CLOSE_RANGE_CLOEXEC)
  if (::syscall(SYS_close_range, static_cast<unsigned>(first), ~0u, CLOSE_RANGE_CLOEXEC) == 0) {
    return;
  }
#endif
  // Kernels before 5.11: walk /proc/self/fd with the raw getdents64 system call.
  int dir = ::open("/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir < 0) {
    const long max_fd = ::sysconf(_SC_OPEN_MAX);
    for (long fd = first; fd < (max_fd > 0 ? max_fd : 65536); ++fd) {
      ::fcntl(static_cast<int>(fd), F_SETFD, FD_CLOEXEC);
    }
    return;
  }
  alignas(8) char buf[4096];
  for (;;) {
    const long n = ::syscall(SYS_getdents64, dir, buf, sizeof(buf));
    if (n <= 0) break;
    for (long off = 0; off < n;) {
      // struct linux_dirent64: u64 d_ino, s64 d_off, u16 d_reclen, u8 d_type, char d_name[].
      unsigned short reclen = 0;
      std::memcpy(&reclen, buf + off + 16, sizeof(reclen));
      const char* name = buf + off + 19;
      int fd = 0;
      bool digits = *name != '\0';
      for (const char* c = name; *c != '\0'; ++c) {
        if (*c < '0' || *c > '9') {
          digits = false;
          break;
        }
        fd = fd * 10 + (*c - '0');
      }
      if (digits && fd >= first && fd != dir) ::fcntl(fd, F_SETFD, FD_CLOEXEC);
      if (reclen == 0) break;
      off += reclen;
    }
  }
  ::close(dir);
}

// Child side after fork: only async-signal-safe calls until execve.
[[noreturn]] void exec_child(const ProcessSpec& spec, char* const* argv, char* const* envp,
                             int ready_write, int secret_read, int heartbeat_write, int error_write,
                             pid_t parent) {
  auto fail = [&](int err) {
    ssize_t ignored = ::write(error_write, &err, sizeof(err));
    (void)ignored;
    _exit(127);
  };
  ::setpgid(0, 0);
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != parent) _exit(126);  // the daemon died before prctl took effect
  // The daemon's event loop blocks the signals it captures; the actor must start clean.
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  for (int sig : {SIGTERM, SIGINT, SIGHUP, SIGPIPE, SIGCHLD, SIGUSR1, SIGUSR2}) {
    ::signal(sig, SIG_DFL);
  }
  int null_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (null_fd < 0) fail(errno);
  int log_fd = ::open(spec.log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
  if (log_fd < 0) fail(errno);
  // Every source goes above the target numbers 0..5 first, so no dup2 clobbers another source.
  // The copies are close-on-exec; dup2's targets are not.
  int sources[6] = {null_fd, log_fd, log_fd, ready_write, secret_read, heartbeat_write};
  int high[6];
  for (int i = 0; i < 6; ++i) {
    high[i] = ::fcntl(sources[i], F_DUPFD_CLOEXEC, 10);
    if (high[i] < 0) fail(errno);
  }
  for (int i = 0; i < 6; ++i) {
    if (::dup2(high[i], i) < 0) fail(errno);
  }
  static_assert(kReadyFd == 3 && kSecretFd == 4 && kHeartbeatFd == 5);
  cloexec_from(kHeartbeatFd + 1);
  ::execve(spec.binary.c_str(), argv, envp);
  fail(errno);
  _exit(127);
}

}  // namespace

Expected<SpawnedProcess> spawn_process(const ProcessSpec& spec) {
  std::vector<std::string> argv_store;
  argv_store.push_back(spec.binary);
  argv_store.insert(argv_store.end(), spec.args.begin(), spec.args.end());
  std::vector<char*> argv;
  for (auto& a : argv_store) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::string> env_store;
  for (const auto& [name, value] : spec.env) env_store.push_back(name + "=" + value);
  std::vector<char*> envp;
  for (auto& e : env_store) envp.push_back(e.data());
  envp.push_back(nullptr);

  if (spec.secret.size() > 4096) return invalid_argument("a child's secret is at most 4 KiB");
  int ready[2] = {-1, -1}, secret[2] = {-1, -1}, heartbeat[2] = {-1, -1}, error[2] = {-1, -1};
  auto close_all = [&]() {
    for (int fd : {ready[0], ready[1], secret[0], secret[1], heartbeat[0], heartbeat[1], error[0],
                   error[1]}) {
      if (fd >= 0) ::close(fd);
    }
  };
  if (::pipe2(ready, O_CLOEXEC) != 0 || ::pipe2(secret, O_CLOEXEC) != 0 ||
      ::pipe2(heartbeat, O_CLOEXEC) != 0 || ::pipe2(error, O_CLOEXEC) != 0) {
    int err = errno;
    close_all();
    return resource_exhausted(std::string("cannot make pipes to start ") + spec.binary + ": " +
                              std::strerror(err));
  }
  // The secret fits in the pipe's buffer: write it now, so the child reads it and then EOF.
  if (!spec.secret.empty() && ::write(secret[1], spec.secret.data(), spec.secret.size()) !=
                                  static_cast<ssize_t>(spec.secret.size())) {
    int err = errno;
    close_all();
    return internal_error(std::string("cannot hand a secret to ") + spec.binary + ": " +
                          std::strerror(err));
  }
  ::close(secret[1]);
  secret[1] = -1;
  pid_t parent = ::getpid();
  pid_t pid = ::fork();
  if (pid < 0) {
    int err = errno;
    close_all();
    return resource_exhausted(std::string("cannot fork to start ") + spec.binary + ": " +
                              std::strerror(err));
  }
  if (pid == 0) {
    exec_child(spec, argv.data(), envp.data(), ready[1], secret[0], heartbeat[1], error[1], parent);
  }

  ::close(ready[1]);
  ::close(secret[0]);
  ::close(heartbeat[1]);
  ::close(error[1]);
  ::fcntl(heartbeat[0], F_SETFL, ::fcntl(heartbeat[0], F_GETFL) | O_NONBLOCK);
  int child_errno = 0;
  ssize_t n;
  do {
    n = ::read(error[0], &child_errno, sizeof(child_errno));
  } while (n < 0 && errno == EINTR);
  ::close(error[0]);
  if (n > 0) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    ::close(ready[0]);
    ::close(heartbeat[0]);
    std::string why = std::strerror(child_errno);
    if (child_errno == ENOENT) return not_found("cannot start " + spec.binary + ": " + why);
    if (child_errno == EACCES) {
      return Status(Code::kPermissionDenied, "cannot start " + spec.binary + ": " + why);
    }
    return internal_error("cannot start " + spec.binary + " (log " + spec.log_path + "): " + why);
  }
  return SpawnedProcess{pid, ready[0], heartbeat[0]};
}

Expected<std::string> resolve_actor_binary(const std::string& bin_dir) {
  std::string path = bin_dir + "/tessera-actor";
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
    return not_found("no actor executable at " + path +
                     " (install tessera-actor next to tessera, or start the daemon with "
                     "--actor-bin-dir)");
  }
  if ((st.st_mode & 0111) == 0 || ::access(path.c_str(), X_OK) != 0) {
    return Status(Code::kPermissionDenied, "the actor executable " + path + " is not executable");
  }
  return path;
}

std::string describe_wait_status(int status) {
  if (WIFEXITED(status)) return "exited with code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    int sig = WTERMSIG(status);
    const char* abbrev = sigabbrev_np(sig);
    std::string out = "killed by signal " + std::to_string(sig);
    if (abbrev != nullptr) out += std::string(" (SIG") + abbrev + ")";
    if (WCOREDUMP(status)) out += ", core dumped";
    return out;
  }
  return "ended with wait status " + std::to_string(status);
}

int wait_exit_code(int status) { return WIFEXITED(status) ? WEXITSTATUS(status) : -1; }
int wait_term_signal(int status) { return WIFSIGNALED(status) ? WTERMSIG(status) : 0; }

std::string tail_file(const std::string& path, size_t max_bytes) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return "";
  in.seekg(0, std::ios::end);
  auto size = static_cast<size_t>(in.tellg());
  size_t start = size > max_bytes ? size - max_bytes : 0;
  in.seekg(static_cast<std::streamoff>(start));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string self_exe_dir() {
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return ".";
  std::string path(buf, static_cast<size_t>(n));
  auto slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

std::vector<std::pair<std::string, std::string>> current_environment() {
  std::vector<std::pair<std::string, std::string>> out;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    std::string entry(*e);
    auto eq = entry.find('=');
    if (eq == std::string::npos) continue;
    out.emplace_back(entry.substr(0, eq), entry.substr(eq + 1));
  }
  return out;
}

}  // namespace tessera
