// A daemon or actor that dies under a running driver, as users meet it: the driver sees the loss
// of a socket within seconds (a dead daemon sends no death report), names the node, and never
// waits out a 10-minute step timeout. `serve` answers 503 meanwhile, starts the group again (a
// new local node when its own died), fails a request that was running each time the group died
// instead of running it again, counts restarts in /metrics, and a SIGTERM always ends it within
// its grace period, leaving nothing behind.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <regex>
#include <sstream>
#include <thread>

#include "tests/integration/test_cluster.h"

namespace tessera {
namespace {

using namespace std::chrono_literals;
using testing::BackgroundProcess;
using testing::bin;
using testing::children_of;
using testing::process_alive;
using testing::processes_matching;
using testing::run_command;
using testing::TestCluster;
using testing::wait_until;

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

std::string source(const std::string& rel) { return std::string(TESSERA_SOURCE_DIR) + "/" + rel; }

std::string curl() {
  for (const char* p : {"/usr/bin/curl", "/bin/curl", "/usr/local/bin/curl"}) {
    if (::access(p, X_OK) == 0) return p;
  }
  return "curl";
}

// Nothing of a local node is left under `root`: no local-* folder, no segment of `daemon`.
void expect_no_local_node_left(const std::string& root, int daemon) {
  EXPECT_TRUE(wait_until(
      [&] {
        for (const auto& e : fs::directory_iterator(root)) {
          if (e.path().filename().string().rfind("local-", 0) == 0) return false;
        }
        return true;
      },
      15s))
      << "a local-* folder is left in " << root;
  for (const auto& e : fs::directory_iterator("/dev/shm")) {
    EXPECT_NE(e.path().filename().string().rfind("tessera-" + std::to_string(daemon) + "-", 0), 0u)
        << e.path() << " of the dead daemon " << daemon << " is left";
  }
}

// `tessera serve` on the CPU backend through a local node under `root`, and curl against it.
class Served {
 public:
  Served(const std::string& model, const std::string& root, std::vector<std::string> extra = {})
      : model_(model) {
    std::vector<std::string> argv = {bin("tessera"), "serve",  model, "--device",
                                     "cpu",          "--port", "0"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    process_ = std::make_unique<BackgroundProcess>(
        argv, std::vector<std::string>{"TESSERA_TMPDIR=" + root});
    wait_until(
        [&] {
          std::smatch m;
          static const std::regex ready("ready on http://127\\.0\\.0\\.1:([0-9]+)");
          const std::string out = process_->out();
          if (std::regex_search(out, m, ready)) base_ = "http://127.0.0.1:" + m[1].str();
          return !base_.empty() || process_->wait(0ms) != -1;
        },
        90s);
  }
  bool ready() const { return !base_.empty(); }
  BackgroundProcess& process() { return *process_; }
  std::string health() const {
    return run_command({curl(), "-s", "-o", "/dev/null", "-w", "%{http_code}", base_ + "/health"},
                       10s)
        .out;
  }
  std::string metrics() const { return run_command({curl(), "-s", base_ + "/metrics"}, 10s).out; }
  // One sample of /metrics, as printed for this model ("name{model_name=...} value").
  bool metric_is(const std::string& name, const std::string& value) const {
    return metrics().find(name + "{model_name=\"" + model_ + "\"} " + value + "\n") !=
           std::string::npos;
  }
  // A curl command posting a completion: its stdout ends with a line holding the HTTP status.
  std::vector<std::string> completion(const std::string& prompt, int max_tokens) const {
    const std::string body = R"({"model":")" + model_ + R"(","prompt":")" + prompt +
                             R"(","max_tokens":)" + std::to_string(max_tokens) +
                             R"(,"ignore_eos":true,"temperature":0})";
    return {curl(),
            "-sS",
            "-w",
            "\n%{http_code}",
            "-H",
            "Content-Type: application/json",
            "-d",
            body,
            base_ + "/v1/completions"};
  }

 private:
  std::string model_;
  std::string base_;
  std::unique_ptr<BackgroundProcess> process_;
};

class RecoveryTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model_ = fs::temp_directory_path() / ("tessera-recovery-model-" + std::to_string(::getpid()));
    fs::remove_all(model_);
    auto r = run_command({bin("tessera"), "make-model", "--arch", "llama", "--preset", "tiny",
                          "--tokenizer", source("tests/assets/tokenizers/llama3"), "--seed", "9",
                          "--out", model_});
    ASSERT_EQ(r.exit_code, 0) << r.err << " (run scripts/fetch-test-assets?)";
  }
  static void TearDownTestSuite() { fs::remove_all(model_); }

  void SetUp() override {
    char tmpl[] = "/tmp/tessera-recovery-XXXXXX";
    root_ = ::mkdtemp(tmpl);
  }
  void TearDown() override { fs::remove_all(root_); }

  std::vector<std::string> long_generate(const std::vector<std::string>& extra = {}) {
    std::vector<std::string> argv = {
        bin("tessera"), "generate",      "--model",   model_,         "--device",
        "cpu",          "--prompt",      "Once upon", "--max-tokens", "6000",
        "--ignore-eos", "--temperature", "0"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return argv;
  }

  // The local daemon a command started under root_ (a child started with --temp-dir
  // <root_>/local-...), once it has exactly one actor; {daemon, actor}.
  std::pair<int, int> local_node_of(BackgroundProcess& p) {
    int daemon = -1, actor = -1;
    bool up = wait_until(
        [&] {
          auto daemons = processes_matching("--temp-dir " + root_ + "/local-");
          if (daemons.size() != 1) return false;
          daemon = daemons[0];
          auto kids = children_of(daemon);
          if (kids.size() != 1) return false;
          actor = kids[0];
          return true;
        },
        60s);
    EXPECT_TRUE(up) << "no local node with an actor: " << p.err();
    return {daemon, actor};
  }

  static inline std::string model_;
  std::string root_;
};

// A SIGKILLed local daemon (its actor dies with it) fails generate within seconds, naming the
// loss, and leaves neither the folder nor the segments behind. It waited 10 minutes before.
TEST_F(RecoveryTest, AKilledLocalDaemonFailsGenerateWithinSeconds) {
  BackgroundProcess p(long_generate(), {"TESSERA_TMPDIR=" + root_});
  const auto [daemon_pid, actor_pid] = local_node_of(p);
  const int daemon = daemon_pid, actor = actor_pid;  // plain ints: lambdas capture them
  ASSERT_GT(daemon, 0);
  ASSERT_TRUE(wait_until([&] { return p.out().size() > 16; }, 60s)) << p.err();
  const auto t0 = Clock::now();
  ASSERT_EQ(::kill(daemon, SIGKILL), 0);
  const int status = p.wait(20s);
  const auto took = Clock::now() - t0;
  ASSERT_NE(status, -1) << "generate still runs 20 s after its daemon died";
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << status;
  EXPECT_LT(took, 5s);
  const std::string err = p.err();
  EXPECT_NE(err.find("tessera generate: "), std::string::npos) << err;
  EXPECT_NE(err.find("lost the connection to"), std::string::npos) << err;
  EXPECT_NE(err.find("node n-"), std::string::npos) << err;
  EXPECT_TRUE(wait_until([&] { return !process_alive(actor); }, 10s));
  expect_no_local_node_left(root_, daemon);
}

// The same through a cluster: generate --address, the head SIGKILLed or stopped gracefully.
TEST_F(RecoveryTest, AHeadThatDiesOrStopsFailsGenerateWithinSeconds) {
  for (bool graceful : {false, true}) {
    SCOPED_TRACE(graceful ? "tessera stop" : "SIGKILL");
    TestCluster cluster;
    const std::string head = cluster.start_head();
    ASSERT_FALSE(head.empty()) << cluster.last().err;
    auto heads = processes_matching("--temp-dir " + cluster.root());
    ASSERT_EQ(heads.size(), 1u);
    BackgroundProcess p(long_generate({"--address", head}), {"TESSERA_TMPDIR=" + cluster.root()});
    ASSERT_TRUE(wait_until([&] { return p.out().size() > 16; }, 60s)) << p.err();
    const auto t0 = Clock::now();
    if (graceful) {
      auto stop = cluster.tessera({"stop"}, 30s, {"TESSERA_TMPDIR=" + cluster.root()});
      EXPECT_EQ(stop.exit_code, 0) << stop.err;
    } else {
      ASSERT_EQ(::kill(heads[0], SIGKILL), 0);
    }
    const int status = p.wait(20s);
    ASSERT_NE(status, -1) << "generate still runs 20 s after its head went";
    EXPECT_LT(Clock::now() - t0, graceful ? 10s : 5s);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << status;
    const std::string err = p.err();
    EXPECT_NE(err.find("tessera generate: "), std::string::npos) << err;
    EXPECT_EQ(err.find("within 10 minutes"), std::string::npos) << err;
    EXPECT_NE(err.find("n-"), std::string::npos) << "names no node: " << err;
  }
}

// A member node's daemon SIGKILLed under a generate whose second stage runs there: the driver
// fails within seconds naming that node (its connection to the head stays up; the member's
// actors die with their daemon, and their sockets say so).
TEST_F(RecoveryTest, AKilledMemberDaemonFailsGenerateNamingItsNode) {
  TestCluster cluster;
  const std::string head = cluster.start_head();
  ASSERT_FALSE(head.empty()) << cluster.last().err;
  const std::string member = cluster.start_member("host-b");
  ASSERT_FALSE(member.empty()) << cluster.last().err;
  const int member_pid = cluster.daemon_pid(member);
  ASSERT_GT(member_pid, 0);
  auto argv = long_generate({"-tp", "2", "-pp", "2", "--address", head});
  argv.insert(argv.begin() + 1, {"--log-level", "info"});  // the plan's lines
  BackgroundProcess p(argv, {"TESSERA_TMPDIR=" + cluster.root()});
  ASSERT_TRUE(wait_until([&] { return p.out().size() > 16; }, 90s)) << p.err();
  ASSERT_NE(p.err().find("host-b"), std::string::npos)
      << "no rank on the member: " << p.err() << p.out();
  const auto t0 = Clock::now();
  ASSERT_EQ(::kill(member_pid, SIGKILL), 0);
  const int status = p.wait(20s);
  ASSERT_NE(status, -1) << "generate still runs 20 s after a member daemon died";
  EXPECT_LT(Clock::now() - t0, 5s);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << status;
  const std::string err = p.err();
  const size_t last = err.rfind("tessera generate: ");
  ASSERT_NE(last, std::string::npos) << err;
  EXPECT_NE(err.find(member, last), std::string::npos)
      << "names not " << member << ": " << err.substr(last);
  std::printf("the driver said: %s", err.substr(last).c_str());
}

// `serve` on a local node whose daemon is SIGKILLed: /health says 503 within seconds, the
// request in flight fails (no 10-minute wait), a new local node is started and the model served
// again, /metrics counts the restart, and SIGTERM then ends the server promptly with nothing
// left behind.
TEST_F(RecoveryTest, ServeRecoversFromAKilledLocalDaemon) {
  Served server(model_, root_);
  ASSERT_TRUE(server.ready()) << server.process().err();
  EXPECT_EQ(server.health(), "200");
  const auto [daemon_pid, actor_pid] = local_node_of(server.process());
  const int daemon = daemon_pid, actor = actor_pid;
  ASSERT_GT(daemon, 0);

  // A long request in flight when the daemon dies.
  BackgroundProcess inflight(server.completion("Once upon a time", 5000));
  ASSERT_TRUE(wait_until([&] { return server.metric_is("vllm:num_requests_running", "1"); }, 30s));
  const auto t0 = Clock::now();
  ASSERT_EQ(::kill(daemon, SIGKILL), 0);
  EXPECT_TRUE(wait_until([&] { return server.health() == "503"; }, 3s))
      << "/health still says 200 after the daemon died";
  ASSERT_NE(inflight.wait(20s), -1) << "the request in flight still waits";
  EXPECT_LT(Clock::now() - t0, 10s);
  EXPECT_NE(inflight.out().find("\n500"), std::string::npos) << inflight.out();
  EXPECT_NE(inflight.out().find("lost the connection"), std::string::npos) << inflight.out();
  EXPECT_EQ(inflight.out().find(root_), std::string::npos)
      << "a server path reached the client: " << inflight.out();
  std::printf("the client in flight got: %s\n", inflight.out().c_str());

  // Back on a new local node.
  EXPECT_TRUE(wait_until([&] { return server.health() == "200"; }, 60s)) << server.process().err();
  auto again = run_command(server.completion("Once upon a time", 8), 60s);
  EXPECT_NE(again.out.find("\n200"), std::string::npos) << again.out;
  EXPECT_TRUE(server.metric_is("tessera:engine_restarts_total", "1")) << server.metrics();
  const auto [daemon2_pid, actor2_pid] = local_node_of(server.process());
  const int daemon2 = daemon2_pid, actor2 = actor2_pid;
  EXPECT_NE(daemon2, daemon);
  EXPECT_FALSE(process_alive(actor));

  const auto t1 = Clock::now();
  ASSERT_EQ(::kill(server.process().pid(), SIGTERM), 0);
  ASSERT_NE(server.process().wait(15s), -1) << "SIGTERM did not end the server";
  EXPECT_LT(Clock::now() - t1, 10s);
  EXPECT_TRUE(wait_until([&] { return !process_alive(daemon2) && !process_alive(actor2); }, 10s));
  expect_no_local_node_left(root_, daemon);
  expect_no_local_node_left(root_, daemon2);
}

// A request that was running each time the group died (here: its actor SIGKILLed during its
// prefill, twice) fails with the cause instead of running a third time; the server goes on.
TEST_F(RecoveryTest, ARequestRunningAtTwoGroupDeathsFailsInsteadOfRunningAgain) {
  // 16 tokens a step: the prompt's prefill runs over many steps, a window to kill its actor in.
  Served server(model_, root_, {"--max-num-batched-tokens", "16", "--max-num-seqs", "4"});
  ASSERT_TRUE(server.ready()) << server.process().err();
  std::ostringstream prompt;
  for (int i = 0; i < 600; ++i) prompt << "word" << i << ' ';
  BackgroundProcess request(server.completion(prompt.str(), 4));
  for (int death = 1; death <= 2; ++death) {
    SCOPED_TRACE("death " + std::to_string(death));
    const auto [daemon_pid, actor_pid] = local_node_of(server.process());
    const int daemon = daemon_pid, actor = actor_pid;
    ASSERT_GT(actor, 0);
    // Running, no token yet: in its prefill.
    ASSERT_TRUE(wait_until(
        [&] {
          return server.metric_is("vllm:num_requests_running", "1") &&
                 server.metric_is("vllm:generation_tokens_total", "0");
        },
        60s));
    ASSERT_EQ(::kill(actor, SIGKILL), 0);
    ASSERT_TRUE(wait_until([&] { return !process_alive(actor); }, 10s));
    if (death == 1) {
      // Restarted: a new actor under the same daemon.
      ASSERT_TRUE(wait_until(
          [&] {
            auto kids = children_of(daemon);
            return kids.size() == 1 && kids[0] != actor;
          },
          60s));
    }
  }
  ASSERT_NE(request.wait(60s), -1);
  EXPECT_NE(request.out().find("\n500"), std::string::npos) << request.out();
  EXPECT_NE(request.out().find("died 2 times while this request was running"), std::string::npos)
      << request.out();
  std::printf("the request got: %s\n", request.out().c_str());
  // The server goes on.
  EXPECT_TRUE(wait_until([&] { return server.health() == "200"; }, 60s));
  EXPECT_TRUE(server.metric_is("tessera:requests_failed_by_restarts_total", "1"))
      << server.metrics();
  ASSERT_EQ(::kill(server.process().pid(), SIGTERM), 0);
  EXPECT_NE(server.process().wait(15s), -1);
}

}  // namespace
}  // namespace tessera
