// Poison requests (issue 24): a legal request whose prefill steps each run far past the step
// timeout completes, because the actor's watchdog measures progress, not a step's length; an
// actor that truly stops in the middle of a step is still killed as hung.
//
// Real processes: a head daemon with a short step timeout (0.5 s) and health timeout (1 s), and
// `tessera generate --address` against it. The test pins itself (and so the daemon, the actor
// and the driver it starts) to one CPU, so a prefill step of 2560 tokens at a 5k context takes
// seconds on any machine, not a fraction of one on a machine with many cores.
#include <gtest/gtest.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "common/session.h"
#include "tests/integration/test_cluster.h"

namespace tessera {
namespace {

using namespace std::chrono_literals;
using testing::BackgroundProcess;
using testing::bin;
using testing::children_of;
using testing::process_alive;
using testing::run_command;
using testing::TestCluster;
using testing::wait_until;

namespace fs = std::filesystem;

std::string source(const std::string& rel) { return std::string(TESSERA_SOURCE_DIR) + "/" + rel; }

// Prompt tokens and the chunk the scheduler cuts them into: two prefill steps, the second of
// 2560 queries over a 5120-token context (about 5 s on one core of a CI machine, ten times the
// step timeout).
constexpr int kPromptTokens = 5120;
constexpr int kChunk = 2560;

class PoisonTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = fs::temp_directory_path() / ("tessera-poison-" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    auto r = run_command({bin("tessera"), "make-model", "--arch", "llama", "--preset", "tiny",
                          "--tokenizer", source("tests/assets/tokenizers/llama3"), "--seed", "3",
                          "--out", dir_ + "/model"});
    ASSERT_EQ(r.exit_code, 0) << r.err << " (run scripts/fetch-test-assets?)";
    std::ofstream prompt(dir_ + "/prompt.jsonl");
    prompt << "{\"prompt_token_ids\": [";
    for (int i = 0; i < kPromptTokens; ++i) prompt << (i ? "," : "") << 100 + (i * 7919) % 1000;
    prompt << "]}\n";
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }

  void SetUp() override {
    // One CPU for everything this test starts (children inherit the mask).
    ASSERT_EQ(::sched_getaffinity(0, sizeof(saved_), &saved_), 0);
    cpu_set_t one;
    CPU_ZERO(&one);
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &saved_)) {
        CPU_SET(c, &one);
        break;
      }
    }
    ASSERT_EQ(::sched_setaffinity(0, sizeof(one), &one), 0);
    head_ = cluster_.start_head({"--actor-step-timeout", "0.5", "--actor-health-timeout", "1"});
    ASSERT_FALSE(head_.empty()) << cluster_.last().out << cluster_.last().err;
  }
  void TearDown() override { ::sched_setaffinity(0, sizeof(saved_), &saved_); }

  std::vector<std::string> generate_argv() const {
    return {bin("tessera"),
            "generate",
            "--address",
            head_,
            "--cluster-token-file",
            cluster_.root() + "/cluster_token",
            "--model",
            dir_ + "/model",
            "--device",
            "cpu",
            "--input",
            dir_ + "/prompt.jsonl",
            "--max-num-batched-tokens",
            std::to_string(kChunk),
            "--max-tokens",
            "2",
            "--temperature",
            "0",
            "--ignore-eos"};
  }
  std::string actor_logs() const { return testing::read_logs(cluster_.root(), "actor-"); }

  static inline std::string dir_;
  cpu_set_t saved_;
  TestCluster cluster_;
  std::string head_;
};

// Each prefill step runs many times the step timeout, ticking all along: the request completes
// and the actor is never declared hung (before the fix it was killed as hung, no heartbeat).
TEST_F(PoisonTest, PrefillStepsLongerThanTheStepTimeoutComplete) {
  auto t0 = std::chrono::steady_clock::now();
  auto r = run_command(generate_argv(), 120s);
  auto took =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
  std::string logs = actor_logs();
  ASSERT_EQ(r.exit_code, 0) << r.err << "\nactor logs:\n" << logs;
  EXPECT_NE(r.err.find(std::to_string(kPromptTokens) + " prompt tokens, 2 output tokens"),
            std::string::npos)
      << r.err;
  // A step really did outlive the timeout (else this machine was too fast for the test to mean
  // anything), and the watchdog saw it progress.
  EXPECT_NE(logs.find("past the step timeout (500 ms), and is still making progress"),
            std::string::npos)
      << logs;
  EXPECT_EQ(logs.find("has made no progress"), std::string::npos) << logs;
  std::printf("[poison] %d-token prompt in %d-token chunks, step timeout 0.5 s: %lld ms\n",
              kPromptTokens, kChunk, static_cast<long long>(took.count()));
}

// SIGSTOP in the middle of the prefill: the whole actor stops, its heartbeat too, and its daemon
// kills it as hung within the health timeout; generate fails naming it.
TEST_F(PoisonTest, AnActorStoppedMidStepIsStillKilledAsHung) {
  BackgroundProcess p(generate_argv());
  auto records = read_daemon_records(cluster_.root());
  ASSERT_EQ(records.size(), 1u);
  int actor = -1;
  ASSERT_TRUE(wait_until(
      [&] {
        auto kids = children_of(records[0].pid);
        if (kids.size() != 1) return false;
        actor = kids[0];
        return actor_logs().find(" loaded LlamaForCausalLM from ") != std::string::npos;
      },
      60s))
      << p.err() << actor_logs();
  std::this_thread::sleep_for(1500ms);  // into the first or second prefill step
  ASSERT_EQ(::kill(actor, SIGSTOP), 0) << "the actor is gone already: " << p.err();
  auto t0 = std::chrono::steady_clock::now();
  int status = p.wait(30s);
  auto took = std::chrono::steady_clock::now() - t0;
  ::kill(actor, SIGCONT);
  ASSERT_NE(status, -1) << "generate still runs 30 s after its actor stopped: " << p.err();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << status << p.err();
  EXPECT_NE(p.err().find("stopped answering"), std::string::npos) << p.err();
  EXPECT_NE(p.err().find("no heartbeat"), std::string::npos) << p.err();
  EXPECT_LT(took, 15s) << p.err();
  EXPECT_TRUE(wait_until([&] { return !process_alive(actor); }, 10s));
}

}  // namespace
}  // namespace tessera
