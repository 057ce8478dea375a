// Faults as users meet them: a generate interrupted by Ctrl-C, SIGTERM or SIGKILL leaves nothing
// behind; an actor killed under a running generate fails it with how the actor died; options
// that make no sense are refused before anything starts; an address that is not Tessera says so.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
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
using testing::wait_until;

namespace fs = std::filesystem;

std::string source(const std::string& rel) { return std::string(TESSERA_SOURCE_DIR) + "/" + rel; }

class FaultsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model_ = fs::temp_directory_path() / ("tessera-faults-model-" + std::to_string(::getpid()));
    fs::remove_all(model_);
    auto r = run_command({bin("tessera"), "make-model", "--arch", "llama", "--preset", "tiny",
                          "--tokenizer", source("tests/assets/tokenizers/llama3"), "--seed", "5",
                          "--out", model_});
    ASSERT_EQ(r.exit_code, 0) << r.err << " (run scripts/fetch-test-assets?)";
  }
  static void TearDownTestSuite() { fs::remove_all(model_); }

  void SetUp() override {
    char tmpl[] = "/tmp/tessera-faults-XXXXXX";
    root_ = ::mkdtemp(tmpl);
  }
  void TearDown() override { fs::remove_all(root_); }

  // A long greedy generate through a local node whose files live under root_.
  std::unique_ptr<BackgroundProcess> start_long_generate(bool async_scheduling = false) {
    std::vector<std::string> argv = {bin("tessera"),
                                     "generate",
                                     "--model",
                                     model_,
                                     "--device",
                                     "cpu",
                                     "--prompt",
                                     "Once upon a time",
                                     "--max-tokens",
                                     "6000",
                                     "--ignore-eos",
                                     "--temperature",
                                     "0"};
    if (async_scheduling) argv.push_back("--async-scheduling");
    return std::make_unique<BackgroundProcess>(argv,
                                               std::vector<std::string>{"TESSERA_TMPDIR=" + root_});
  }

  // Waits until the driver streams text: the local daemon and its actor are up and stepping.
  // Returns the local daemon's pid and its actor's.
  std::pair<int, int> wait_until_generating(BackgroundProcess& p) {
    int daemon = -1, actor = -1;
    bool up = wait_until(
        [&] {
          if (p.out().size() < 16) return false;
          auto daemons = processes_matching("--temp-dir " + root_ + "/local-");
          if (daemons.size() != 1) return false;
          daemon = daemons[0];
          auto kids = children_of(daemon);
          if (kids.size() != 1) return false;
          actor = kids[0];
          return true;
        },
        60s);
    EXPECT_TRUE(up) << "generate never got going: " << p.err();
    return {daemon, actor};
  }

  // Nothing of the run is left: processes, local folder, shared-memory segments.
  void expect_nothing_left(int daemon, int actor) {
    EXPECT_TRUE(wait_until([&] { return !process_alive(daemon) && !process_alive(actor); }, 15s))
        << "daemon " << daemon << " alive " << process_alive(daemon) << ", actor " << actor
        << " alive " << process_alive(actor);
    EXPECT_TRUE(wait_until(
        [&] {
          for (const auto& e : fs::directory_iterator(root_)) {
            if (e.path().filename().string().rfind("local-", 0) == 0) return false;
          }
          return true;
        },
        15s))
        << "a local-* folder is left in " << root_;
    for (const auto& e : fs::directory_iterator("/dev/shm")) {
      EXPECT_NE(e.path().filename().string().rfind("tessera-" + std::to_string(daemon) + "-", 0),
                0u)
          << e.path();
    }
  }

  static inline std::string model_;
  std::string root_;
};

TEST_F(FaultsTest, CtrlCOfGenerateLeavesNothingBehind) {
  auto p = start_long_generate();
  auto [daemon, actor] = wait_until_generating(*p);
  ASSERT_GT(daemon, 0);
  ASSERT_EQ(::kill(-p->pid(), SIGINT), 0);  // the terminal signals the whole foreground group
  int status = p->wait(20s);
  ASSERT_NE(status, -1) << "generate ignored Ctrl-C";
  expect_nothing_left(daemon, actor);
}

TEST_F(FaultsTest, SigtermOfGenerateLeavesNothingBehind) {
  auto p = start_long_generate();
  auto [daemon, actor] = wait_until_generating(*p);
  ASSERT_GT(daemon, 0);
  ASSERT_EQ(::kill(p->pid(), SIGTERM), 0);
  ASSERT_NE(p->wait(20s), -1);
  expect_nothing_left(daemon, actor);
}

TEST_F(FaultsTest, SigkillOfGenerateLeavesNothingBehind) {
  auto p = start_long_generate();
  auto [daemon, actor] = wait_until_generating(*p);
  ASSERT_GT(daemon, 0);
  ASSERT_EQ(::kill(p->pid(), SIGKILL), 0);
  ASSERT_NE(p->wait(20s), -1);
  expect_nothing_left(daemon, actor);
}

// Also with --async-scheduling, where the actor has two steps running when it dies.
TEST_F(FaultsTest, AKilledActorFailsGenerateWithHowItDied) {
  for (bool async_scheduling : {false, true}) {
    auto p = start_long_generate(async_scheduling);
    auto [daemon, actor] = wait_until_generating(*p);
    ASSERT_GT(actor, 0);
    ASSERT_EQ(::kill(actor, SIGKILL), 0);
    int status = p->wait(30s);
    ASSERT_NE(status, -1);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << status;
    std::string err = p->err();
    EXPECT_NE(err.find("tessera generate: actor a-"), std::string::npos) << err;
    EXPECT_NE(err.find("(CPU on node n-"), std::string::npos) << err;
    EXPECT_NE(err.find("was killed by signal 9 (SIGKILL); its log: "), std::string::npos) << err;
    EXPECT_EQ(err.find("Peer disconnected"), std::string::npos) << err;
    expect_nothing_left(daemon, actor);
    // The log it names outlives the local node's folder, and is the dead actor's.
    const std::string said = "its log: ";
    const size_t at = err.find(said);
    ASSERT_NE(at, std::string::npos) << err;
    const size_t end = err.find_first_of("\n ", at + said.size());
    const std::string log = err.substr(at + said.size(), end - at - said.size());
    EXPECT_TRUE(fs::exists(log)) << log << " named in: " << err;
    EXPECT_EQ(log.rfind(root_ + "/failed-logs/", 0), 0u) << log;
    std::ifstream in(log);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_NE(text.find("actor"), std::string::npos) << log;
    // The driver's last line, what a remote client would be told too, names no path.
    const size_t last = err.rfind("tessera generate: ");
    ASSERT_NE(last, std::string::npos) << err;
    EXPECT_EQ(err.find(root_, last), std::string::npos) << err.substr(last);
  }
}

TEST_F(FaultsTest, OptionsThatMakeNoSenseAreRefusedBeforeAnythingStarts) {
  struct Case {
    std::vector<std::string> args;
    std::string says;
    int exit_code = 1;  // 2: a usage error, refused while the flags are parsed
  };
  std::vector<Case> cases = {
      {{"--max-num-seqs", "0"}, "--max-num-seqs must be between 1 and 65536"},
      {{"--logprobs", "-3"}, "logprobs must be between 0 and 20"},
      {{"--stop-token-ids", "99999999"}, "stop token id 99999999 is outside the vocabulary"},
      {{"--gpu-memory-utilization", "1.5"}, "--gpu-memory-utilization must be in (0, 1]"},
      {{"--device", "tpu"}, "--device 'tpu' is not one of auto, cuda, cpu", 2},
      {{"-tp", "two"}, "--tensor-parallel-size must be a positive integer or auto, got 'two'", 2},
  };
  for (const auto& c : cases) {
    std::vector<std::string> argv = {bin("tessera"), "generate", "--model",
                                     model_,         "--prompt", "hi"};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    auto t0 = std::chrono::steady_clock::now();
    auto r = run_command(argv, 30s, {"TESSERA_TMPDIR=" + root_});
    auto took = std::chrono::steady_clock::now() - t0;
    EXPECT_EQ(r.exit_code, c.exit_code) << c.args[0];
    EXPECT_NE(r.err.find(c.says), std::string::npos) << r.err;
    EXPECT_LT(took, 1500ms) << c.args[0] << " took long: did a node start?";
    EXPECT_TRUE(fs::is_empty(root_)) << "something started for " << c.args[0];
  }
  auto start = run_command(
      {bin("tessera"), "start", "--head", "--object-store-memory", "0", "--temp-dir", root_});
  EXPECT_EQ(start.exit_code, 2);
  EXPECT_NE(start.err.find("--object-store-memory"), std::string::npos) << start.err;
}

TEST_F(FaultsTest, AnAddressThatIsNotTesseraSaysSo) {
  // An HTTP-ish server on loopback.
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  ::inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(fd, 4), 0);
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  std::thread server([fd] {
    int c = ::accept(fd, nullptr, nullptr);
    if (c < 0) return;
    char buf[256];
    ssize_t ignored = ::recv(c, buf, sizeof(buf), 0);
    const char reply[] = "HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n";
    ignored = ::send(c, reply, sizeof(reply) - 1, MSG_NOSIGNAL);
    (void)ignored;
    ::close(c);
  });
  std::string address = "127.0.0.1:" + std::to_string(ntohs(addr.sin_port));
  auto r = run_command({bin("tessera"), "status", "--address", address}, 30s,
                       {"TESSERA_CLUSTER_TOKEN=0123456789abcdef0123"});
  ::shutdown(fd, SHUT_RDWR);
  server.join();
  ::close(fd);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("not a Tessera daemon at " + address), std::string::npos) << r.err;
}

}  // namespace
}  // namespace tessera
