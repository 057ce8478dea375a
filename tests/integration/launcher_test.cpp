// The cluster launchers: scripts/tessera-up and scripts/tessera-down bring a 3-host cluster up
// and down over "ssh" (a stand-in the test writes, running each command in a network namespace
// of its own with a temp root of its own, as a separate machine would), the cluster token never
// showing on a command line; `tessera stop --all` from a member; and the remote shutdown as an
// attacker without the token would try it.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "common/session.h"
#include "driver/client.h"
#include "protocol/cluster.capnp.h"
#include "protocol/node.capnp.h"
#include "protocol/rpc.h"
#include "tests/integration/test_cluster.h"

#ifndef TESSERA_SOURCE_DIR
#define TESSERA_SOURCE_DIR "."
#endif

namespace tessera {
namespace {

using namespace std::chrono_literals;
using testing::bin;
using testing::cmdline_of;
using testing::CommandResult;
using testing::process_alive;
using testing::processes_matching;
using testing::run_command;
using testing::TestCluster;
using testing::wait_until;
namespace fs = std::filesystem;

using testing::ip_binary;

bool ip(std::vector<std::string> args) {
  args.insert(args.begin(), ip_binary());
  return run_command(args, 20s).exit_code == 0;
}

std::string script(const std::string& name) {
  return std::string(TESSERA_SOURCE_DIR) + "/scripts/" + name;
}

void write_file(const std::string& path, const std::string& text, mode_t mode) {
  {
    std::ofstream out(path);
    out << text;
  }
  ::chmod(path.c_str(), mode);
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

size_t count(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

// Three "machines": network namespaces on a bridge (in a namespace of its own), host i named
// tsl-<pid>-<i> at 10.215.<n>.<i + 1>. Without them (no root), every host is this machine's
// loopback and the test says so loudly.
class Hosts {
 public:
  explicit Hosts(size_t n) {
    const std::string id = std::to_string(::getpid() % 100000);
    const std::string net = "10.215." + std::to_string(::getpid() % 250 + 1) + ".";
    bridge_ = "tsl-" + id + "-br";
    ok_ = ip({"netns", "add", bridge_}) &&
          ip({"-n", bridge_, "link", "add", "br0", "type", "bridge"}) &&
          ip({"-n", bridge_, "link", "set", "br0", "up"});
    for (size_t i = 0; i < n; ++i) {
      names_.push_back("tsl-" + id + "-" + std::to_string(i));
      addrs_.push_back(net + std::to_string(i + 1));
      const std::string peer = "h" + std::to_string(i);
      ok_ = ok_ && ip({"netns", "add", names_[i]}) &&
            ip({"-n", names_[i], "link", "add", "eth0", "type", "veth", "peer", "name", peer,
                "netns", bridge_}) &&
            ip({"-n", bridge_, "link", "set", peer, "master", "br0"}) &&
            ip({"-n", bridge_, "link", "set", peer, "up"}) &&
            ip({"-n", names_[i], "addr", "add", addrs_[i] + "/24", "dev", "eth0"}) &&
            ip({"-n", names_[i], "link", "set", "eth0", "up"}) &&
            ip({"-n", names_[i], "link", "set", "lo", "up"});
    }
    if (!ok_) {
      for (auto& a : addrs_) a = "127.0.0.1";
      std::fprintf(stderr,
                   "\n*** [launcher] NETWORK NAMESPACES ARE NOT AVAILABLE HERE (ip netns needs "
                   "root / CAP_NET_ADMIN): the ssh stand-in runs every host on this machine's "
                   "loopback, each with a temp root of its own ***\n\n");
    }
  }
  ~Hosts() {
    for (const auto& n : names_) ip({"netns", "del", n});
    ip({"netns", "del", bridge_});
  }
  bool ok() const { return ok_; }
  const std::string& name(size_t i) const { return names_[i]; }
  const std::string& addr(size_t i) const { return addrs_[i]; }
  size_t size() const { return names_.size(); }

 private:
  std::vector<std::string> names_, addrs_;
  std::string bridge_;
  bool ok_ = false;
};

// Every process whose command line contains `needle` while it runs: a thread reading
// /proc/*/cmdline over and over.
class CmdlineWatch {
 public:
  explicit CmdlineWatch(std::string needle) : needle_(std::move(needle)) {
    thread_ = std::thread([this] {
      while (!stop_) {
        std::error_code ec;
        for (const auto& e : fs::directory_iterator("/proc", ec)) {
          const std::string name = e.path().filename().string();
          if (name.find_first_not_of("0123456789") != std::string::npos) continue;
          const std::string cmd = cmdline_of(std::atoi(name.c_str()));
          ++processes_seen_;
          if (cmd.find(needle_) != std::string::npos) {
            std::lock_guard<std::mutex> lock(mu_);
            hits_.insert(cmd);
          }
        }
        ++scans_;
      }
    });
  }
  ~CmdlineWatch() { stop(); }
  void stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  std::set<std::string> hits() {
    std::lock_guard<std::mutex> lock(mu_);
    return hits_;
  }
  uint64_t scans() const { return scans_; }

 private:
  std::string needle_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> scans_{0}, processes_seen_{0};
  std::mutex mu_;
  std::set<std::string> hits_;
  std::thread thread_;
};

class LauncherTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/tessera-launch-XXXXXX";
    base_ = ::mkdtemp(tmpl);
    fs::create_directories(base_ + "/tmp");
    ::chmod((base_ + "/tmp").c_str(), 0700);
    // ssh [-o OPTION | -FLAG]... HOST COMMAND...: COMMAND in HOST's namespace, with HOST's own
    // temp root (its "disk"); stdin passes through. Every call is logged.
    std::string enter = hosts_.ok() ? ip_binary() + " netns exec \"$host\" " : "";
    write_file(base_ + "/ssh",
               "#!/bin/sh\n"
               "while [ $# -gt 0 ]; do\n"
               "  case \"$1\" in -o) shift 2 ;; -*) shift ;; *) break ;; esac\n"
               "done\n"
               "host=$1; shift\n"
               "printf '%s %s\\n' \"$host\" \"$*\" >> " +
                   base_ + "/ssh.log\n" + "exec " + enter + "env TESSERA_TMPDIR=" + base_ +
                   "/roots/\"$host\" TMPDIR=" + base_ + "/tmp sh -c \"$*\"\n",
               0755);
    std::string lines = "# a test cluster\n\n";
    for (size_t i = 0; i < hosts_.size(); ++i) {
      lines += hosts_.name(i) + " " + hosts_.addr(i) + "\n";
    }
    write_file(base_ + "/hosts", lines, 0644);
  }

  void TearDown() override {
    // Whatever a failed test left running.
    for (size_t i = 0; i < hosts_.size(); ++i) {
      run_command({bin("tessera"), "stop", "--temp-dir", root(i), "--timeout", "5"}, 30s);
    }
    std::error_code ec;
    fs::remove_all(base_, ec);
  }

  std::string root(size_t host) const { return base_ + "/roots/" + hosts_.name(host); }

  std::vector<std::string> env() const {
    return {"TESSERA_SSH=" + base_ + "/ssh", "TESSERA_REMOTE_BIN=" + bin("tessera")};
  }

  // `tessera ARGS` on host `i`, through the stand-in as the scripts run it.
  CommandResult on_host(size_t i, const std::string& args) {
    return run_command(
        {base_ + "/ssh", "-o", "BatchMode=yes", hosts_.name(i), bin("tessera") + " " + args}, 60s);
  }

  CommandResult up(const std::vector<std::string>& flags) {
    std::vector<std::string> argv = {script("tessera-up"), base_ + "/hosts"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    for (std::string a : {"--", "--heartbeat-ms", "200"}) argv.push_back(a);
    return run_command(argv, 120s, env());
  }

  // The daemons of this test's hosts still running.
  std::vector<int> daemons() {
    return processes_matching("--node-name tsl-" + std::to_string(::getpid() % 100000) + "-");
  }

  // Checks `tessera status` on host `from` lists the three hosts alive, by their names.
  void expect_three_alive(size_t from) {
    auto r = on_host(from, "status --json");
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    auto j = nlohmann::json::parse(r.out, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << r.out;
    std::set<std::string> names;
    size_t alive = 0;
    for (const auto& n : j["nodes"]) {
      alive += n.value("alive", false) ? 1 : 0;
      names.insert(n.value("name", ""));
      if (hosts_.ok()) {
        // Each node listens on its own namespace's address.
        std::string address = n.value("address", "");
        EXPECT_EQ(address.rfind("10.215.", 0), 0u) << address;
      }
    }
    EXPECT_EQ(alive, 3u) << r.out;
    EXPECT_EQ(names, (std::set<std::string>{hosts_.name(0), hosts_.name(1), hosts_.name(2)}));
  }

  Hosts hosts_{3};
  std::string base_;
};

// tessera-up with a token file: the head on the first host, members on the others, all alive in
// `tessera status`; the token on no command line at any moment (nor in what ssh was asked to
// run); tessera-down stops every daemon and leaves no records.
TEST_F(LauncherTest, UpBringsThreeHostsUpAndDownTakesThemDown) {
  const std::string token = "launcher-test-token-" + std::to_string(::getpid()) + "-0123456789ab";
  write_file(base_ + "/token", token + "\n", 0600);
  CmdlineWatch watch(token);
  auto r = up({"--port", hosts_.ok() ? "6380" : "0", "--token-file", base_ + "/token"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  std::printf("[launcher] tessera-up printed:\n%s", r.out.c_str());
  EXPECT_NE(r.out.find("Tessera cluster up: head at " + hosts_.addr(0) + ":"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("2 member(s)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("export TESSERA_ADDRESS="), std::string::npos) << r.out;
  expect_three_alive(0);
  expect_three_alive(2);
  EXPECT_EQ(daemons().size(), 3u);
  // Every daemon has the token in its own root, private; the temp files it came in are gone.
  for (size_t i = 0; i < 3; ++i) {
    struct stat st {};
    ASSERT_EQ(::stat((root(i) + "/cluster_token").c_str(), &st), 0) << root(i);
    EXPECT_EQ(st.st_mode & 0777, 0600u);
    EXPECT_EQ(read_file(root(i) + "/cluster_token"), token + "\n");
  }
  EXPECT_TRUE(fs::is_empty(base_ + "/tmp")) << "a token file was left behind";

  auto down = run_command({script("tessera-down"), base_ + "/hosts"}, 120s, env());
  EXPECT_EQ(down.exit_code, 0) << down.out << down.err;
  EXPECT_EQ(count(down.out, "Stopped "), 3u) << down.out;
  std::printf("[launcher] tessera-down printed:\n%s", down.out.c_str());
  EXPECT_TRUE(wait_until([&] { return daemons().empty(); }, 15s));
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_TRUE(read_daemon_records(root(i)).empty()) << root(i);
  }
  EXPECT_FALSE(fs::exists(root(0) + "/head_address"));

  watch.stop();
  EXPECT_GT(watch.scans(), 10u);
  EXPECT_TRUE(watch.hits().empty()) << "the token was on a command line: " << *watch.hits().begin();
  EXPECT_EQ(read_file(base_ + "/ssh.log").find(token), std::string::npos);
}

// tessera-up without a token file (the head makes one; the members get it read back from the
// head), then `tessera stop --all` on a member: one line per node, every daemon gone.
TEST_F(LauncherTest, StopAllFromAMemberStopsTheWholeCluster) {
  auto r = up({"--port", "0"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  expect_three_alive(1);
  const std::string token = read_file(root(0) + "/cluster_token");
  ASSERT_GE(token.size(), 16u);
  EXPECT_EQ(read_file(root(2) + "/cluster_token"), token);
  for (int pid : daemons()) {
    EXPECT_EQ(cmdline_of(pid).find(token.substr(0, 16)), std::string::npos) << cmdline_of(pid);
  }
  EXPECT_EQ(read_file(base_ + "/ssh.log").find(token.substr(0, 16)), std::string::npos);

  auto stop = on_host(2, "stop --all");
  EXPECT_EQ(stop.exit_code, 0) << stop.out << stop.err;
  EXPECT_EQ(count(stop.out, "Stopped node "), 2u) << stop.out;
  EXPECT_EQ(count(stop.out, "Stopped head "), 1u) << stop.out;
  for (size_t i = 0; i < 3; ++i) EXPECT_NE(stop.out.find(hosts_.name(i)), std::string::npos);
  EXPECT_TRUE(wait_until([&] { return daemons().empty(); }, 15s));
  for (size_t i = 0; i < 3; ++i) EXPECT_TRUE(read_daemon_records(root(i)).empty()) << root(i);
  // The head's log says who asked.
  std::string logs = testing::read_logs(root(0), "daemon-");
  EXPECT_NE(logs.find("stopping the cluster: tessera stop --all from"), std::string::npos) << logs;
}

// The head is gone (SIGKILL): `tessera stop --all` cannot reach it, so tessera-down falls back
// to `tessera stop` on every host, which stops the members and clears the head's stale record.
TEST_F(LauncherTest, DownFallsBackToEachHostWhenTheHeadIsGone) {
  auto r = up({"--port", "0"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  int head_pid = -1;
  for (const auto& rec : read_daemon_records(root(0))) head_pid = rec.pid;
  ASSERT_GT(head_pid, 0);
  ::kill(head_pid, SIGKILL);
  ASSERT_TRUE(wait_until([&] { return !process_alive(head_pid); }, 10s));
  auto down = run_command({script("tessera-down"), base_ + "/hosts"}, 120s, env());
  EXPECT_EQ(down.exit_code, 0) << down.out << down.err;
  EXPECT_NE(down.err.find("`tessera stop --all` failed; stopping each host's daemons"),
            std::string::npos)
      << down.err;
  EXPECT_EQ(count(down.out, "Stopped node "), 2u) << down.out << down.err;
  EXPECT_TRUE(wait_until([&] { return daemons().empty(); }, 15s));
  for (size_t i = 0; i < 3; ++i) EXPECT_TRUE(read_daemon_records(root(i)).empty()) << root(i);
}

class LauncherStopAllTest : public ::testing::Test {
 protected:
  TestCluster cluster_;
  EventLoop loop_;
};

// Without the token nothing can stop a node: not a wrong or missing token, not a client that
// calls shutdown / stopCluster on the bootstrap capability before proving it. With it,
// Node.shutdown stops that one node (the head sees it leave) and `tessera stop --all` the rest.
TEST_F(LauncherStopAllTest, OnlyAPeerWithTheTokenCanShutNodesDown) {
  const std::string head = cluster_.start_head();
  ASSERT_FALSE(head.empty()) << cluster_.last().out << cluster_.last().err;
  const std::string m1 = cluster_.start_member("m1"), m2 = cluster_.start_member("m2");
  ASSERT_FALSE(m1.empty() || m2.empty()) << cluster_.last().err;
  const int head_pid = [&] {
    for (const auto& r : read_daemon_records(cluster_.root())) {
      if (r.role == "head") return r.pid;
    }
    return -1;
  }();
  const int m1_pid = cluster_.daemon_pid(m1), m2_pid = cluster_.daemon_pid(m2);
  ASSERT_GT(head_pid, 0);

  // The CLI with a wrong token: refused, nothing stopped.
  write_file(cluster_.root() + "/wrong", "not-the-token-0123456789abcdef\n", 0600);
  auto cli = cluster_.tessera(
      {"stop", "--all", "--address", head, "--cluster-token-file", cluster_.root() + "/wrong"});
  EXPECT_EQ(cli.exit_code, 1);
  EXPECT_NE(cli.err.find("wrong cluster token"), std::string::npos) << cli.err;
  auto none = rpc::connect(loop_.io(), head, "intruder", "").wait(loop_.wait_scope());
  ASSERT_FALSE(none);
  EXPECT_EQ(none.status().code(), Code::kPermissionDenied);

  // A hand-made client calling shutdown on what it got before authenticating (the Gateway), at
  // the head and at a member: the calls fail, no daemon stops.
  for (const std::string& address : {head, std::string()}) {
    std::string target = address;
    if (target.empty()) {
      for (const auto& r : read_daemon_records(cluster_.root())) {
        if (r.node_id == m1) target = r.address;
      }
    }
    auto stream = loop_.io()
                      .provider->getNetwork()
                      .parseAddress(target)
                      .then([](kj::Own<kj::NetworkAddress> a) { return a->connect(); })
                      .wait(loop_.wait_scope());
    capnp::TwoPartyClient client(*stream);
    auto boot = client.bootstrap();
    auto shutdown = boot.castAs<proto::Node>().shutdownRequest();
    shutdown.setReason("attacker");
    EXPECT_TRUE(kj::runCatchingExceptions([&] { shutdown.send().wait(loop_.wait_scope()); }) !=
                nullptr)
        << target;
    auto stop = boot.castAs<proto::Cluster>().stopClusterRequest();
    stop.setReason("attacker");
    EXPECT_TRUE(kj::runCatchingExceptions([&] { stop.send().wait(loop_.wait_scope()); }) != nullptr)
        << target;
  }
  std::this_thread::sleep_for(300ms);
  EXPECT_TRUE(process_alive(head_pid));
  EXPECT_TRUE(process_alive(m1_pid));
  EXPECT_TRUE(process_alive(m2_pid));
  EXPECT_EQ(testing::read_logs(cluster_.root(), "daemon-").find("shutdown requested"),
            std::string::npos);

  // With the token, Node.shutdown on one member stops that member only.
  std::string m1_address;
  for (const auto& r : read_daemon_records(cluster_.root())) {
    if (r.node_id == m1) m1_address = r.address;
  }
  {
    auto conn =
        rpc::connect(loop_.io(), m1_address, "test", cluster_.token()).wait(loop_.wait_scope());
    ASSERT_TRUE(conn) << conn.status().to_string();
    auto req = (*conn)->node.shutdownRequest();
    req.setReason("the test");
    EXPECT_TRUE(kj::runCatchingExceptions([&] { req.send().wait(loop_.wait_scope()); }) == nullptr);
  }
  EXPECT_TRUE(wait_until([&] { return !process_alive(m1_pid); }, 10s));
  EXPECT_TRUE(process_alive(head_pid));
  EXPECT_TRUE(process_alive(m2_pid));
  auto status = cluster_.tessera({"status", "--temp-dir", cluster_.root(), "--json"});
  EXPECT_NE(status.out.find("its daemon was stopped (the test)"), std::string::npos) << status.out;

  // `tessera stop --all` (head and token from the root, as `tessera status` finds them).
  auto all = cluster_.tessera({"stop", "--all", "--temp-dir", cluster_.root()});
  EXPECT_EQ(all.exit_code, 0) << all.out << all.err;
  EXPECT_NE(all.out.find("Stopped node " + m2 + " (m2)"), std::string::npos) << all.out;
  EXPECT_NE(all.out.find("Stopped head "), std::string::npos) << all.out;
  EXPECT_EQ(count(all.out, "Stopped "), 2u) << all.out;
  // It returns once this machine's daemons are gone, their records and the head's address too.
  EXPECT_FALSE(process_alive(head_pid));
  EXPECT_FALSE(process_alive(m2_pid));
  EXPECT_TRUE(read_daemon_records(cluster_.root()).empty());
  EXPECT_FALSE(fs::exists(cluster_.root() + "/head_address"));
  auto again = cluster_.tessera({"stop", "--all", "--temp-dir", cluster_.root()});
  EXPECT_EQ(again.exit_code, 1);
}

}  // namespace
}  // namespace tessera
