#include "daemon/session.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace tessera {

namespace fs = std::filesystem;

std::string temp_root(const std::string& flag) {
  if (!flag.empty()) return flag;
  const char* env = std::getenv("TESSERA_TMPDIR");
  if (env != nullptr && *env != '\0') return env;
  return "/tmp/tessera";
}

bool pid_running(int pid) {
  if (pid <= 0) return false;
  if (::kill(pid, 0) != 0 && errno == ESRCH) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string content((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  auto paren = content.rfind(')');
  if (paren != std::string::npos && paren + 2 < content.size()) return content[paren + 2] != 'Z';
  return true;
}

uint64_t unix_ms() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count());
}

Expected<std::string> create_session_dir(const std::string& root) {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  localtime_r(&t, &tm);
  char stamp[64];
  std::strftime(stamp, sizeof(stamp), "%Y-%m-%d_%H-%M-%S", &tm);
  std::string dir = root + "/session_" + stamp + "_" + std::to_string(::getpid());
  std::error_code ec;
  fs::create_directories(dir + "/logs", ec);
  if (ec) return unavailable("cannot create session directory " + dir + ": " + ec.message());
  std::string latest = root + "/session_latest";
  fs::remove(latest, ec);
  fs::create_directory_symlink(dir, latest, ec);  // best effort
  return dir;
}

namespace {

nlohmann::json to_json(const DaemonRecord& r) {
  return {{"pid", r.pid},         {"address", r.address},         {"role", r.role},
          {"node_id", r.node_id}, {"session_dir", r.session_dir}, {"head_address", r.head_address}};
}

Status write_file_atomically(const std::string& path, const std::string& content) {
  std::string tmp = path + ".tmp" + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::trunc);
    if (!out) return unavailable("cannot write " + tmp);
    out << content;
    if (!out.flush()) return unavailable("cannot write " + tmp);
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) return unavailable("cannot rename " + tmp + " to " + path + ": " + ec.message());
  return Status::ok();
}

}  // namespace

Status write_daemon_record(const std::string& root, const DaemonRecord& record) {
  std::error_code ec;
  fs::create_directories(root + "/daemons", ec);
  if (ec) return unavailable("cannot create " + root + "/daemons: " + ec.message());
  return write_file_atomically(root + "/daemons/" + std::to_string(record.pid) + ".json",
                               to_json(record).dump(2) + "\n");
}

void remove_daemon_record(const std::string& root, int pid) {
  std::error_code ec;
  fs::remove(root + "/daemons/" + std::to_string(pid) + ".json", ec);
}

std::vector<DaemonRecord> read_daemon_records(const std::string& root) {
  std::vector<DaemonRecord> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root + "/daemons", ec)) {
    if (entry.path().extension() != ".json") continue;
    std::ifstream in(entry.path());
    nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.contains("pid")) {
      fs::remove(entry.path(), ec);
      continue;
    }
    DaemonRecord r;
    r.pid = j.value("pid", 0);
    r.address = j.value("address", "");
    r.role = j.value("role", "");
    r.node_id = j.value("node_id", "");
    r.session_dir = j.value("session_dir", "");
    r.head_address = j.value("head_address", "");
    if (!pid_running(r.pid)) {
      fs::remove(entry.path(), ec);  // stale: that daemon is gone
      continue;
    }
    out.push_back(r);
  }
  return out;
}

Status write_head_address(const std::string& root, const std::string& address) {
  std::error_code ec;
  fs::create_directories(root, ec);
  return write_file_atomically(root + "/head_address", address + "\n");
}

Expected<std::string> read_head_address(const std::string& root) {
  std::ifstream in(root + "/head_address");
  std::string address;
  if (!in || !std::getline(in, address) || address.empty()) {
    return not_found("no head was started from " + root +
                     "; start one with `tessera start --head`, or pass --address HOST:PORT");
  }
  return address;
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

}  // namespace tessera
