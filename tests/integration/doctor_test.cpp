// `tessera doctor` against real clusters of this machine: healthy, then one real fault each —
// a /dev/shm too small (a mount namespace with a 16 MiB tmpfs), a low open-files limit, a
// stopped daemon, a skewed clock (libfaketime; built as doctor_clock_test, for the release
// build only), a rank whose actor cannot start — each named with its fix, and the exit status 1.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>

#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/integration/test_cluster.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using testing::bin;
using testing::CommandResult;
using testing::TestCluster;
using namespace std::chrono_literals;

// The findings of `tessera doctor --json`, or a test failure.
nlohmann::json findings_of(const CommandResult& r) {
  auto j = nlohmann::json::parse(r.out, nullptr, false);
  if (j.is_discarded() || !j.contains("findings")) {
    ADD_FAILURE() << "not doctor's JSON:\n" << r.out << "\n" << r.err;
    return nlohmann::json::array();
  }
  return j["findings"];
}

// The findings of `check` on nodes whose label contains `node` with `verdict`.
std::vector<nlohmann::json> with(const nlohmann::json& findings, const std::string& node,
                                 const std::string& check, const std::string& verdict) {
  std::vector<nlohmann::json> out;
  for (const auto& f : findings) {
    if (f["node"].get<std::string>().find(node) != std::string::npos && f["check"] == check &&
        f["verdict"] == verdict) {
      out.push_back(f);
    }
  }
  return out;
}

class DoctorTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_NE(cluster_.start_head(), "") << cluster_.last().err; }

  CommandResult doctor(std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {
        "doctor",         "--temp-dir", cluster_.root(),     "--json", "--node-timeout", "3",
        "--join-timeout", "20",         "--allreduce-bytes", "65536"};
    args.insert(args.end(), extra.begin(), extra.end());
    return cluster_.tessera(args, 120s, {"TESSERA_TMPDIR=" + cluster_.root()});
  }

  // `tessera start --address <head>` for a member named `name`, the command wrapped by
  // `prefix` (a program and its arguments that exec the rest) and run with `env`, `max_fds`.
  std::string start_member(const std::string& name, std::vector<std::string> prefix = {},
                           std::vector<std::string> env = {}, int max_fds = 0) {
    std::vector<std::string> argv = std::move(prefix);
    for (std::string a :
         {bin("tessera"), std::string("start"), std::string("--address"), cluster_.head_address(),
          std::string("--temp-dir"), cluster_.root(), std::string("--node-name"), name}) {
      argv.push_back(a);
    }
    env.push_back("TESSERA_TMPDIR=" + cluster_.root());
    auto r = testing::run_command(argv, 60s, env, max_fds);
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    auto pos = r.out.find("Started node ");
    if (pos == std::string::npos) return "";
    auto start = pos + std::string("Started node ").size();
    return r.out.substr(start, r.out.find(' ', start) - start);
  }

  TestCluster cluster_;
};

#ifndef TESSERA_DOCTOR_CLOCK_TEST
TEST_F(DoctorTest, AHealthyClusterPassesWithARealAllReduceAcrossItsNodes) {
  ASSERT_NE(start_member("worker"), "");
  auto r = doctor();
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  auto f = findings_of(r);
  for (const auto& x : f) EXPECT_NE(x["verdict"], "fail") << x.dump();
  for (const char* check : {"alive", "shm", "nofile", "disk", "clock", "gpus"}) {
    EXPECT_EQ(with(f, "[head]", check, "fail").size(), 0u) << check;
    EXPECT_EQ(with(f, "worker", check, "fail").size(), 0u) << check;
  }
  // Each node reaches the other's daemon.
  EXPECT_EQ(with(f, "[head]", "reach", "pass").size(), 1u) << r.out;
  EXPECT_EQ(with(f, "worker", "reach", "pass").size(), 1u) << r.out;
  // One rank per node, a pipeline group of two, every sum checked.
  auto ar = with(f, "cluster", "allreduce", "pass");
  ASSERT_EQ(ar.size(), 1u) << r.out;
  EXPECT_NE(ar[0]["detail"].get<std::string>().find("1 x 2 ranks (tcp), pipeline groups of 2"),
            std::string::npos)
      << ar[0].dump();
  EXPECT_NE(ar[0]["detail"].get<std::string>().find("every sum checked"), std::string::npos);

  // The text report says the same, one line per finding.
  auto text =
      cluster_.tessera({"doctor", "--temp-dir", cluster_.root(), "--allreduce-bytes", "65536"},
                       120s, {"TESSERA_TMPDIR=" + cluster_.root()});
  EXPECT_EQ(text.exit_code, 0) << text.out << text.err;
  EXPECT_NE(text.out.find("PASS allreduce: "), std::string::npos) << text.out;
  EXPECT_NE(text.out.find(" 0 failed"), std::string::npos) << text.out;
}

TEST_F(DoctorTest, WithAModelItPlansItsMemoryAndComparesTensorParallelLogitsToOneRank) {
  std::string model = cluster_.root() + "/model";
  auto made = testing::run_command(
      {bin("tessera"), "make-model", "--arch", "llama", "--preset", "tiny", "--tokenizer",
       std::string(TESSERA_SOURCE_DIR) + "/tests/assets/tokenizers/llama3", "--seed", "5",
       "--dtype", "bf16", "--out", model});
  ASSERT_EQ(made.exit_code, 0) << made.err << " (run scripts/fetch-test-assets?)";
  auto r = doctor({"--model", model, "-tp", "2"});
  EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
  auto f = findings_of(r);
  auto memory = with(f, "cluster", "memory", "pass");
  ASSERT_EQ(memory.size(), 1u) << r.out;
  EXPECT_NE(memory[0]["detail"].get<std::string>().find("-tp 2 -pp 1"), std::string::npos);
  auto ar = with(f, "cluster", "allreduce", "pass");
  ASSERT_EQ(ar.size(), 1u) << r.out;
  EXPECT_NE(ar[0]["detail"].get<std::string>().find("2 x 1 ranks (tcp)"), std::string::npos);
  auto parity = with(f, "cluster", "parity", "pass");
  ASSERT_EQ(parity.size(), 1u) << r.out;
  EXPECT_NE(parity[0]["detail"].get<std::string>().find("greedy tokens identical"),
            std::string::npos)
      << parity[0];

  // A plan the cluster cannot place fails with the way out.
  auto big = doctor({"--model", model, "-tp", "2", "-pp", "64"});
  EXPECT_EQ(big.exit_code, 1) << big.out;
  EXPECT_EQ(with(findings_of(big), "cluster", "plan", "fail").size(), 1u) << big.out;
}

TEST_F(DoctorTest, ASharedMemoryTooSmallFailsWithTheDockerFix) {
  // The member's daemon runs in a mount namespace of its own whose /dev/shm is 16 MiB, as in a
  // container started without --shm-size.
  std::string shell = "mount -t tmpfs -o size=16m tmpfs /dev/shm && exec \"$@\"";
  std::string id =
      start_member("small-shm", {"/usr/bin/unshare", "-m", "/bin/sh", "-c", shell, "sh"});
  ASSERT_NE(id, "");
  auto r = doctor();
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  auto f = findings_of(r);
  auto bad = with(f, "small-shm", "shm", "fail");
  ASSERT_EQ(bad.size(), 1u) << r.out;
  EXPECT_NE(bad[0]["detail"].get<std::string>().find("16 MiB"), std::string::npos) << bad[0];
  EXPECT_NE(bad[0]["fix"].get<std::string>().find("--shm-size"), std::string::npos) << bad[0];
  EXPECT_EQ(with(f, "[head]", "shm", "fail").size(), 0u) << "only the member's is small";
}

TEST_F(DoctorTest, ALowOpenFilesLimitFailsWithHowToRaiseIt) {
  ASSERT_NE(start_member("few-files", {}, {}, /*max_fds=*/256), "");
  auto r = doctor();
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  auto f = findings_of(r);
  auto bad = with(f, "few-files", "nofile", "fail");
  ASSERT_EQ(bad.size(), 1u) << r.out;
  EXPECT_NE(bad[0]["detail"].get<std::string>().find("256"), std::string::npos) << bad[0];
  EXPECT_NE(bad[0]["fix"].get<std::string>().find("LimitNOFILE"), std::string::npos) << bad[0];
}

TEST_F(DoctorTest, AStoppedDaemonFailsInBoundedTimeAndTheAllReduceIsNotTried) {
  std::string id = start_member("stopped");
  ASSERT_NE(id, "");
  int pid = cluster_.daemon_pid(id);
  ASSERT_GT(pid, 0);
  ASSERT_EQ(::kill(pid, SIGSTOP), 0);
  auto t0 = std::chrono::steady_clock::now();
  auto r = doctor();
  auto took = std::chrono::steady_clock::now() - t0;
  ::kill(pid, SIGCONT);
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  EXPECT_LT(took, 30s);
  auto f = findings_of(r);
  auto bad = with(f, "stopped", "alive", "fail");
  ASSERT_EQ(bad.size(), 1u) << r.out;
  EXPECT_NE(bad[0]["detail"].get<std::string>().find("did not answer"), std::string::npos)
      << bad[0];
  EXPECT_NE(bad[0]["fix"].get<std::string>().find("SIGSTOP"), std::string::npos) << bad[0];
  EXPECT_EQ(with(f, "cluster", "allreduce", "fail").size(), 1u) << r.out;
  // The head still answered for itself.
  EXPECT_EQ(with(f, "[head]", "alive", "pass").size(), 1u) << r.out;
}

TEST_F(DoctorTest, ARankThatCannotJoinIsNamedWithItsNode) {
  // The member's tessera-actor is its own copy, removed after the daemon started: a node whose
  // install broke under it. Its rank of the collective check cannot start.
  std::string dir = cluster_.root() + "/broken-bin";
  fs::create_directories(dir);
  fs::copy_file(bin("tessera-actor"), dir + "/tessera-actor");
  std::vector<std::string> argv = {
      bin("tessera"),  "start",       "--address", cluster_.head_address(), "--temp-dir",
      cluster_.root(), "--node-name", "broken2",   "--actor-bin-dir",       dir};
  auto s = testing::run_command(argv, 60s, {"TESSERA_TMPDIR=" + cluster_.root()});
  ASSERT_EQ(s.exit_code, 0) << s.out << s.err;
  fs::remove(dir + "/tessera-actor");
  auto r = doctor();
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  auto f = findings_of(r);
  auto actor = with(f, "broken2", "actor", "fail");
  ASSERT_EQ(actor.size(), 1u) << r.out;
  auto ar = with(f, "cluster", "allreduce", "fail");
  ASSERT_EQ(ar.size(), 1u) << r.out;
  const std::string detail = ar[0]["detail"];
  // "cannot start rank 1 on CPU on node n-…: spawn actor: no actor executable at …"
  auto at = s.out.find("Started node ");
  ASSERT_NE(at, std::string::npos) << s.out;
  const std::string id = s.out.substr(at + 13, s.out.find(' ', at + 13) - at - 13);
  EXPECT_NE(detail.find("rank 1 on CPU on node " + id), std::string::npos) << detail;
  EXPECT_NE(detail.find("no actor executable"), std::string::npos) << detail;
}

#else
// libfaketime cannot be preloaded into sanitizer-built programs (it deadlocks in ASan's own
// start-up), so this fault runs against the release build: the doctor_clock_test target, label
// release, which scripts/test runs there.
TEST_F(DoctorTest, AClockSkewedByTwoMinutesFails) {
  const std::string lib = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";
  ASSERT_TRUE(fs::exists(lib)) << lib << " is missing: scripts/setup installs faketime";
  // The member's daemon reads a wall clock two minutes ahead (its monotonic clock is left
  // alone).
  ASSERT_NE(start_member("skewed", {},
                         {"LD_PRELOAD=" + lib, "FAKETIME=+120s", "FAKETIME_DONT_FAKE_MONOTONIC=1"}),
            "");
  auto r = doctor();
  EXPECT_EQ(r.exit_code, 1) << r.out << r.err;
  auto f = findings_of(r);
  auto bad = with(f, "skewed", "clock", "fail");
  ASSERT_EQ(bad.size(), 1u) << r.out;
  EXPECT_NE(bad[0]["detail"].get<std::string>().find("+120"), std::string::npos) << bad[0];
  EXPECT_NE(bad[0]["fix"].get<std::string>().find("NTP"), std::string::npos) << bad[0];
  EXPECT_EQ(with(f, "[head]", "clock", "pass").size(), 1u) << r.out;
}
#endif

}  // namespace
}  // namespace tessera
