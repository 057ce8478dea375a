#include "common/session.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace tessera {

namespace fs = std::filesystem;

namespace {

std::string read_small_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Checks that `dir` is a real directory (not a symlink) of this user that nobody else may write.
Status check_private_dir(const std::string& dir) {
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) {
    return unavailable("cannot inspect " + dir + ": " + std::strerror(errno));
  }
  const std::string fix =
      "; remove it or pass --temp-dir (or $TESSERA_TMPDIR) to use another folder";
  if (S_ISLNK(st.st_mode))
    return failed_precondition("refusing to use " + dir + ": it is a symlink" + fix);
  if (!S_ISDIR(st.st_mode))
    return failed_precondition("refusing to use " + dir + ": not a directory" + fix);
  if (st.st_uid != ::geteuid()) {
    return failed_precondition("refusing to use " + dir + ": it belongs to uid " +
                               std::to_string(st.st_uid) + ", not to this user (uid " +
                               std::to_string(::geteuid()) + ")" + fix);
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    return failed_precondition("refusing to use " + dir +
                               ": other users may write to it (chmod 700 " + dir + ")");
  }
  return Status::ok();
}

Status write_file_atomically(const std::string& path, const std::string& content, mode_t mode) {
  std::string tmp = path + ".tmp" + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, mode);
  if (fd < 0) return unavailable("cannot write " + tmp + ": " + std::strerror(errno));
  ::fchmod(fd, mode);  // umask may have narrowed it; never widen beyond `mode`
  size_t done = 0;
  while (done < content.size()) {
    ssize_t n = ::write(fd, content.data() + done, content.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      return unavailable("cannot write " + tmp + ": " + std::strerror(err));
    }
    done += static_cast<size_t>(n);
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    return unavailable("cannot rename " + tmp + " to " + path + ": " + std::strerror(err));
  }
  return Status::ok();
}

// "<pid> <start time>" files that name the process owning a folder.
Status write_owner_file(const std::string& dir) {
  int pid = ::getpid();
  return write_file_atomically(
      dir + "/owner", std::to_string(pid) + " " + std::to_string(process_start_time(pid)) + "\n",
      0600);
}

// Whether the process named by `dir`/owner still runs. A folder without an owner file is
// treated as live while it is young (its owner may be between mkdir and writing the file).
bool owner_alive(const std::string& dir) {
  std::istringstream in(read_small_file(dir + "/owner"));
  int pid = 0;
  uint64_t start = 0;
  if (!(in >> pid >> start)) {
    std::error_code ec;
    auto written = fs::last_write_time(dir, ec);
    if (ec) return false;
    return fs::file_time_type::clock::now() - written < std::chrono::minutes(1);
  }
  return same_process(pid, start);
}

nlohmann::json to_json(const DaemonRecord& r) {
  return {{"pid", r.pid},
          {"start_time", r.start_time},
          {"address", r.address},
          {"role", r.role},
          {"node_id", r.node_id},
          {"session_dir", r.session_dir},
          {"head_address", r.head_address},
          {"executable", r.executable}};
}

std::string default_root() {
  const char* env = std::getenv("TESSERA_TMPDIR");
  if (env != nullptr && *env != '\0') return env;
  return "/tmp/tessera-" + std::to_string(::geteuid());
}

}  // namespace

Expected<std::string> open_root(const std::string& flag) {
  std::string root = flag.empty() ? default_root() : flag;
  while (root.size() > 1 && root.back() == '/') root.pop_back();
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(root, ec))) {
    fs::create_directories(fs::path(root).parent_path(), ec);
    if (::mkdir(root.c_str(), 0700) != 0 && errno != EEXIST) {
      return unavailable("cannot create " + root + ": " + std::strerror(errno));
    }
  }
  TESSERA_RETURN_IF_ERROR(check_private_dir(root));
  return root;
}

Expected<std::string> create_session_dir(const std::string& root) {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  localtime_r(&t, &tm);
  char stamp[64];
  std::strftime(stamp, sizeof(stamp), "%Y-%m-%d_%H-%M-%S", &tm);
  std::string dir = root + "/session_" + stamp + "_" + std::to_string(::getpid());
  if (::mkdir(dir.c_str(), 0700) != 0) {
    return unavailable("cannot create session directory " + dir + ": " + std::strerror(errno));
  }
  TESSERA_RETURN_IF_ERROR(write_owner_file(dir));
  if (::mkdir((dir + "/logs").c_str(), 0700) != 0) {
    return unavailable("cannot create " + dir + "/logs: " + std::strerror(errno));
  }
  std::string latest = root + "/session_latest";
  std::error_code ec;
  fs::remove(latest, ec);
  fs::create_directory_symlink(dir, latest, ec);  // best effort
  return dir;
}

Status write_daemon_record(const DaemonRecord& record) {
  return write_file_atomically(record.session_dir + "/daemon.json", to_json(record).dump(2) + "\n",
                               0600);
}

void remove_daemon_record(const DaemonRecord& record) {
  std::error_code ec;
  fs::remove(record.session_dir + "/daemon.json", ec);
}

std::vector<DaemonRecord> read_daemon_records(const std::string& root) {
  std::vector<DaemonRecord> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    if (entry.is_symlink() || !entry.is_directory()) continue;
    if (entry.path().filename().string().rfind("session_", 0) != 0) continue;
    std::string path = entry.path().string() + "/daemon.json";
    if (!fs::exists(path)) continue;
    nlohmann::json j = nlohmann::json::parse(read_small_file(path), nullptr, false);
    DaemonRecord r;
    if (!j.is_discarded() && j.is_object()) {
      r.pid = j.value("pid", 0);
      r.start_time = j.value("start_time", uint64_t{0});
      r.address = j.value("address", "");
      r.role = j.value("role", "");
      r.node_id = j.value("node_id", "");
      r.session_dir = j.value("session_dir", "");
      r.head_address = j.value("head_address", "");
      r.executable = j.value("executable", "");
    }
    if (r.pid <= 0 || !same_process(r.pid, r.start_time)) {
      fs::remove(path, ec);  // stale: that daemon is gone (or its pid went to someone else)
      continue;
    }
    out.push_back(r);
  }
  return out;
}

Status write_head_address(const std::string& root, const std::string& address) {
  return write_file_atomically(root + "/head_address", address + "\n", 0600);
}

Expected<std::string> read_head_address(const std::string& root) {
  std::istringstream in(read_small_file(root + "/head_address"));
  std::string address;
  if (std::getline(in, address) && !address.empty()) return address;
  for (const DaemonRecord& r : read_daemon_records(root)) {
    if (!r.head_address.empty()) return r.head_address;
  }
  return not_found("no cluster was started from " + root +
                   "; start one with `tessera start --head`, or pass --address HOST:PORT "
                   "(or set TESSERA_ADDRESS)");
}

Expected<std::string> find_cluster_root(const std::string& flag) {
  if (!flag.empty()) return open_root(flag);
  TESSERA_ASSIGN_OR_RETURN(std::string base, open_root(""));
  auto has_cluster = [](const std::string& root) { return read_head_address(root).has_value(); };
  if (has_cluster(base)) return base;
  std::istringstream in(read_small_file(base + "/current_root"));
  std::string recorded;
  std::error_code ec;
  if (std::getline(in, recorded) && !recorded.empty() && recorded != base &&
      fs::is_directory(recorded, ec)) {
    // The recorded root is only a hint: it must pass open_root's ownership checks again (and
    // one that was deleted since is not created again).
    Expected<std::string> other = open_root(recorded);
    if (other && has_cluster(*other)) return other;
  }
  return base;
}

Status record_current_root(const std::string& root) {
  TESSERA_ASSIGN_OR_RETURN(std::string base, open_root(""));
  if (root == base) {
    std::error_code ec;
    fs::remove(base + "/current_root", ec);
    return Status::ok();
  }
  std::error_code ec;
  const std::string absolute = fs::absolute(root, ec).lexically_normal().string();
  return write_file_atomically(base + "/current_root", (ec ? root : absolute) + "\n", 0600);
}

void remove_head_address(const std::string& root) {
  std::error_code ec;
  fs::remove(root + "/head_address", ec);
}

std::string cluster_token_path(const std::string& root) { return root + "/cluster_token"; }

Status write_secret_file(const std::string& path, const std::string& content) {
  return write_file_atomically(path, content + "\n", 0600);
}

uint64_t process_start_time(int pid) {
  if (pid <= 0) return 0;
  std::string content = read_small_file("/proc/" + std::to_string(pid) + "/stat");
  auto paren = content.rfind(')');
  if (paren == std::string::npos) return 0;
  std::istringstream fields(content.substr(paren + 1));
  std::string field;
  // Field 3 (state) comes first after the command name; the start time is field 22.
  for (int i = 3; i <= 22; ++i) {
    if (!(fields >> field)) return 0;
    if (i == 3 && field == "Z") return 0;
  }
  return std::strtoull(field.c_str(), nullptr, 10);
}

bool pid_running(int pid) { return process_start_time(pid) != 0; }

bool same_process(int pid, uint64_t start_time) {
  uint64_t now = process_start_time(pid);
  return now != 0 && now == start_time;
}

std::string process_command_line(int pid) {
  std::string raw = read_small_file("/proc/" + std::to_string(pid) + "/cmdline");
  std::replace(raw.begin(), raw.end(), '\0', ' ');
  while (!raw.empty() && raw.back() == ' ') raw.pop_back();
  return raw;
}

std::string process_executable(int pid) {
  if (pid <= 0) return "";
  char buf[4096];
  const std::string link = "/proc/" + std::to_string(pid) + "/exe";
  ssize_t n = ::readlink(link.c_str(), buf, sizeof(buf) - 1);
  if (n <= 0) return "";
  std::string path(buf, static_cast<size_t>(n));
  const std::string deleted = " (deleted)";
  if (path.size() > deleted.size() &&
      path.compare(path.size() - deleted.size(), deleted.size(), deleted) == 0) {
    path.resize(path.size() - deleted.size());
  }
  return path;
}

bool daemon_still_running(const DaemonRecord& record, std::string* why) {
  auto fail = [&](const std::string& text) {
    if (why != nullptr) *why = text;
    return false;
  };
  if (record.pid <= 0) return fail("the record names no pid");
  if (!same_process(record.pid, record.start_time)) {
    return fail(pid_running(record.pid) ? "it is another process than the daemon that started "
                                          "there (the pid was reused)"
                                        : "it no longer runs");
  }
  const std::string exe = process_executable(record.pid);
  if (exe.empty()) return fail("its program cannot be inspected (another user's process?)");
  const bool same =
      record.executable.empty() ? fs::path(exe).filename() == "tessera" : exe == record.executable;
  if (!same) {
    return fail("it runs " + exe + ", not " +
                (record.executable.empty() ? std::string("tessera") : record.executable) +
                " as the daemon recorded");
  }
  return true;
}

std::string shm_prefix_for_this_process() {
  int pid = ::getpid();
  return "/tessera-" + std::to_string(pid) + "-" + std::to_string(process_start_time(pid)) + "-";
}

CleanupReport cleanup_stale(const std::string& root, const std::string& shm_dir) {
  CleanupReport report;
  std::error_code ec;
  // Segments: tessera-<pid>-<start>-<rest>, this user's only.
  for (const auto& entry : fs::directory_iterator(shm_dir, ec)) {
    std::string name = entry.path().filename().string();
    if (name.rfind("tessera-", 0) != 0) continue;
    std::istringstream parts(name.substr(8));
    std::string pid_text, start_text;
    if (!std::getline(parts, pid_text, '-') || !std::getline(parts, start_text, '-')) continue;
    if (pid_text.empty() || start_text.empty() ||
        pid_text.find_first_not_of("0123456789") != std::string::npos ||
        start_text.find_first_not_of("0123456789") != std::string::npos) {
      continue;
    }
    struct stat st {};
    if (::lstat(entry.path().c_str(), &st) != 0 || st.st_uid != ::geteuid()) continue;
    int pid = std::atoi(pid_text.c_str());
    if (same_process(pid, std::strtoull(start_text.c_str(), nullptr, 10))) continue;
    if (::shm_unlink(("/" + name).c_str()) == 0) {
      ++report.segments;
      report.segment_bytes += static_cast<uint64_t>(st.st_size);
    }
  }
  if (report.segments > 0) {
    report.lines.push_back(
        "removed " + std::to_string(report.segments) + " shared-memory segment(s) (" +
        std::to_string(report.segment_bytes >> 20) + " MiB) left by daemons that no longer run");
  }
  // Session folders of daemons that no longer run; the newest of them stays for its logs.
  struct Dead {
    fs::path path;
    fs::file_time_type written;
  };
  std::vector<Dead> dead;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    std::string name = entry.path().filename().string();
    if (entry.is_symlink() || !entry.is_directory()) continue;
    if (name.rfind("session_", 0) == 0) {
      if (!owner_alive(entry.path().string())) {
        dead.push_back({entry.path(), fs::last_write_time(entry.path(), ec)});
      }
    } else if (name.rfind("local-", 0) == 0) {
      std::string dir = entry.path().string();
      if (owner_alive(dir) || !read_daemon_records(dir).empty()) continue;
      fs::remove_all(entry.path(), ec);
      if (!ec) {
        ++report.local_dirs;
        report.lines.push_back("removed " + dir + ": its command no longer runs");
      }
    }
  }
  std::sort(dead.begin(), dead.end(),
            [](const Dead& a, const Dead& b) { return a.written > b.written; });
  for (size_t i = 1; i < dead.size(); ++i) {
    fs::remove_all(dead[i].path, ec);
    if (!ec) ++report.sessions;
  }
  if (report.sessions > 0) {
    report.lines.push_back("removed " + std::to_string(report.sessions) +
                           " session folder(s) of daemons that no longer run from " + root +
                           " (kept the newest, " + dead[0].path.filename().string() + ")");
  }
  return report;
}

Expected<std::string> create_local_dir(const std::string& root) {
  std::string tmpl = root + "/local-XXXXXX";
  if (::mkdtemp(tmpl.data()) == nullptr) {
    return unavailable("cannot create a folder for a local node in " + root + ": " +
                       std::strerror(errno));
  }
  TESSERA_RETURN_IF_ERROR(write_owner_file(tmpl));
  return tmpl;
}

std::string detect_node_ip() {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return "127.0.0.1";
  std::string found;
  for (ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    if ((a->ifa_flags & IFF_UP) == 0 || (a->ifa_flags & IFF_LOOPBACK) != 0) continue;
    char host[INET_ADDRSTRLEN] = {0};
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, host, sizeof(host));
    found = host;
    break;
  }
  ::freeifaddrs(list);
  return found.empty() ? "127.0.0.1" : found;
}

bool is_loopback_host(const std::string& host) {
  return host == "localhost" || host == "::1" || host == "[::1]" || host.rfind("127.", 0) == 0;
}

uint64_t unix_ms() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count());
}

}  // namespace tessera
