// Distributed generate end to end on the CPU backend: real daemons, one actor process per rank,
// the tcp collectives between them, the driver placing T x P ranks. Checked against
// transformers' greedy tokens (tests/assets/goldens). Multi-host runs a head and a member in two
// network namespaces joined by a veth pair; where the kernel (or a missing CAP_NET_ADMIN) refuses
// namespaces the test says so loudly and runs both daemons on loopback with distinct node
// identities instead. A rank that dies or never joins during the rendezvous fails start-up in
// bounded time, naming it, and leaves nothing running.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "tests/integration/test_cluster.h"

namespace tessera {
namespace {

using namespace std::chrono_literals;
using testing::BackgroundProcess;
using testing::bin;
using testing::cmdline_of;
using testing::CommandResult;
using testing::process_alive;
using testing::processes_matching;
using testing::run_command;
using testing::TestCluster;
using testing::wait_until;
namespace fs = std::filesystem;

std::string source(const std::string& rel) { return std::string(TESSERA_SOURCE_DIR) + "/" + rel; }

class DistributedTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = fs::temp_directory_path() / ("tessera-dist-" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    std::ifstream in(source("tests/assets/goldens/model_qwen3.json"));
    golden_ = nlohmann::json::parse(in);
    auto r =
        run_command({bin("tessera"), "make-model", "--arch", "qwen3", "--preset", "tiny",
                     "--tokenizer", source("tests/assets/tokenizers/qwen3"), "--seed",
                     std::to_string(golden_["seed"].get<int>()), "--dtype", "bf16", "--out", dir_});
    ASSERT_EQ(r.exit_code, 0) << r.err << " (run scripts/fetch-test-assets?)";
  }
  static void TearDownTestSuite() { fs::remove_all(dir_); }

  // The golden case's prompt and its greedy tokens.
  static const nlohmann::json& golden_case() { return golden_["cases"][1]; }

  static std::vector<std::string> generate_args() {
    const auto& c = golden_case();
    return {"generate",
            "--model",
            dir_,
            "--device",
            "cpu",
            "--prompt",
            c["prompt"].get<std::string>(),
            "--temperature",
            "0",
            "--max-tokens",
            "32",
            "--ignore-eos",
            "--json"};
  }

  // The output ids of a `generate --json` run (empty when it failed).
  static std::vector<int32_t> output_ids(const CommandResult& r) {
    if (r.exit_code != 0) return {};
    std::string out = r.out;
    while (!out.empty() && out.back() == '\n') out.pop_back();
    auto j = nlohmann::json::parse(out.substr(out.rfind('\n') + 1));
    return j["output_ids"].get<std::vector<int32_t>>();
  }

  static std::vector<int32_t> expected() {
    return golden_case()["greedy"].get<std::vector<int32_t>>();
  }

  static inline std::string dir_;
  static inline nlohmann::json golden_;
};

// Every split of the tiny model (4 heads, 2 KV heads, 4 layers) gives transformers' tokens, each
// rank a process of its own; a pipeline split prints its stages.
TEST_F(DistributedTest, EverySplitGivesTransformersTokens) {
  for (std::vector<std::string> split : {std::vector<std::string>{"-tp", "2"},
                                         {"-tp", "4"},
                                         {"-pp", "2"},
                                         {"-tp", "2", "-pp", "2"},
                                         {"--pipeline-layer-partition", "1,3"}}) {
    std::vector<std::string> argv = {bin("tessera")};
    for (const auto& a : generate_args()) argv.push_back(a);
    argv.insert(argv.end(), split.begin(), split.end());
    auto r = run_command(argv, 120s);
    std::string name;
    for (const auto& s : split) name += s + " ";
    ASSERT_EQ(r.exit_code, 0) << name << r.err;
    EXPECT_EQ(output_ids(r), expected()) << name;
    EXPECT_NE(r.err.find("plan: stage 0: "), std::string::npos) << name << r.err;
  }
}

// The mixture-of-experts models over processes: every split of each tiny MoE model gives
// transformers' greedy tokens (tests/assets/goldens/model_<arch>.json, made on the GPU machine by
// scripts/goldens/model_goldens.py). A missing golden fails the test, naming the file.
TEST(MoeDistributedTest, EverySplitOfEachMoeModelGivesTransformersTokens) {
  for (const char* arch : {"mixtral", "qwen2_moe", "qwen3_moe"}) {
    const std::string path = source("tests/assets/goldens/model_" + std::string(arch) + ".json");
    std::ifstream in(path);
    if (!in) {
      ADD_FAILURE() << "missing golden " << path
                    << ": make it on the GPU machine with scripts/goldens/model_goldens.py";
      continue;
    }
    const nlohmann::json golden = nlohmann::json::parse(in);
    const std::string dir = fs::temp_directory_path() / ("tessera-dist-" + std::string(arch) + "-" +
                                                         std::to_string(::getpid()));
    fs::remove_all(dir);
    auto made = run_command(
        {bin("tessera"), "make-model", "--arch", arch, "--preset", "tiny", "--tokenizer",
         source("tests/assets/tokenizers/" + golden["tokenizer"].get<std::string>()), "--seed",
         std::to_string(golden["seed"].get<int>()), "--dtype", "bf16", "--out", dir});
    ASSERT_EQ(made.exit_code, 0) << made.err;
    const nlohmann::json& c = golden["cases"][1];
    for (std::vector<std::string> split : {std::vector<std::string>{"-tp", "2"},
                                           {"-tp", "4"},
                                           {"-pp", "2"},
                                           {"-tp", "2", "-pp", "2"}}) {
      std::vector<std::string> argv = {
          bin("tessera"),  "generate", "--model",      dir,
          "--device",      "cpu",      "--prompt",     c["prompt"].get<std::string>(),
          "--temperature", "0",        "--max-tokens", "32",
          "--ignore-eos",  "--json"};
      argv.insert(argv.end(), split.begin(), split.end());
      auto r = run_command(argv, 120s);
      std::string name = std::string(arch) + " ";
      for (const auto& s : split) name += s + " ";
      ASSERT_EQ(r.exit_code, 0) << name << r.err;
      std::string out = r.out;
      while (!out.empty() && out.back() == '\n') out.pop_back();
      auto j = nlohmann::json::parse(out.substr(out.rfind('\n') + 1));
      EXPECT_EQ(j["output_ids"].get<std::vector<int32_t>>(),
                c["greedy"].get<std::vector<int32_t>>())
          << name;
    }
    fs::remove_all(dir);
  }
}

std::string ip_path() {
  for (const char* p : {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"}) {
    if (::access(p, X_OK) == 0) return p;
  }
  return "ip";
}

// Runs `ip ...`; true when it succeeded.
bool ip(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {ip_path()};
  argv.insert(argv.end(), args.begin(), args.end());
  return run_command(argv, 20s).exit_code == 0;
}

// Two network namespaces joined by a veth pair (10.213.<n>.1 and .2), removed on destruction.
class NetnsPair {
 public:
  NetnsPair() {
    const std::string id = std::to_string(::getpid() % 100000);
    a_ = "tsr-" + id + "-a";
    b_ = "tsr-" + id + "-b";
    const std::string va = "tsr" + id + "a", vb = "tsr" + id + "b";
    const std::string net = "10.213." + std::to_string(::getpid() % 250 + 1) + ".";
    addr_a_ = net + "1";
    addr_b_ = net + "2";
    ok_ = ip({"netns", "add", a_}) && ip({"netns", "add", b_}) &&
          ip({"link", "add", va, "type", "veth", "peer", "name", vb}) &&
          ip({"link", "set", va, "netns", a_}) && ip({"link", "set", vb, "netns", b_}) &&
          ip({"-n", a_, "addr", "add", addr_a_ + "/24", "dev", va}) &&
          ip({"-n", b_, "addr", "add", addr_b_ + "/24", "dev", vb}) &&
          ip({"-n", a_, "link", "set", va, "up"}) && ip({"-n", b_, "link", "set", vb, "up"}) &&
          ip({"-n", a_, "link", "set", "lo", "up"}) && ip({"-n", b_, "link", "set", "lo", "up"});
  }
  ~NetnsPair() {
    ip({"netns", "del", a_});
    ip({"netns", "del", b_});
  }
  bool ok() const { return ok_; }
  std::vector<std::string> in_a() const { return {ip_path(), "netns", "exec", a_}; }
  std::vector<std::string> in_b() const { return {ip_path(), "netns", "exec", b_}; }
  const std::string& addr_a() const { return addr_a_; }
  const std::string& addr_b() const { return addr_b_; }

 private:
  std::string a_, b_, addr_a_, addr_b_;
  bool ok_ = false;
};

std::vector<std::string> cat(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// A TP=2 x PP=2 plan over two nodes (two "machines": network namespaces): the stages go to
// different nodes, the ranks of a stage stay together, the pipeline's activations cross the
// veth link, and the tokens are transformers'.
TEST_F(DistributedTest, TwoHostsRunATp2Pp2Plan) {
  NetnsPair net;
  std::string head, token_file, root_a, root_b;
  std::vector<std::string> driver_prefix;
  std::unique_ptr<TestCluster> loopback;
  if (net.ok()) {
    std::printf("[multi-host] network namespaces: head at %s, member at %s (veth)\n",
                net.addr_a().c_str(), net.addr_b().c_str());
    char ta[] = "/tmp/tessera-dist-a-XXXXXX";
    char tb[] = "/tmp/tessera-dist-b-XXXXXX";
    root_a = ::mkdtemp(ta);
    root_b = ::mkdtemp(tb);
    auto r =
        run_command(cat(net.in_a(), {bin("tessera"), "start", "--head", "--port", "0", "--node-ip",
                                     net.addr_a(), "--temp-dir", root_a, "--node-name", "host-a"}));
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    EXPECT_NE(r.out.find(net.addr_a()), std::string::npos) << "the start-up line names the "
                                                              "exposed interface: "
                                                           << r.out;
    std::ifstream in(root_a + "/head_address");
    std::getline(in, head);
    token_file = root_a + "/cluster_token";
    r = run_command(cat(net.in_b(), {bin("tessera"), "start", "--address", head, "--node-ip",
                                     net.addr_b(), "--temp-dir", root_b, "--node-name", "host-b",
                                     "--cluster-token-file", token_file}));
    ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
    driver_prefix = net.in_a();
  } else {
    std::fprintf(stderr,
                 "\n*** [multi-host] NETWORK NAMESPACES ARE NOT AVAILABLE HERE (ip netns needs "
                 "root / CAP_NET_ADMIN and a kernel that allows them): falling back to two "
                 "daemons on loopback with distinct node identities ***\n\n");
    loopback = std::make_unique<TestCluster>();
    head = loopback->start_head();
    ASSERT_FALSE(head.empty()) << loopback->last().err;
    ASSERT_FALSE(loopback->start_member("host-b").empty()) << loopback->last().err;
    token_file = loopback->root() + "/cluster_token";
  }
  std::vector<std::string> argv = driver_prefix;
  argv.push_back(bin("tessera"));
  for (const auto& a : generate_args()) argv.push_back(a);
  for (std::string a : {"-tp", "2", "-pp", "2", "--address"}) argv.push_back(a);
  argv.push_back(head);
  argv.push_back("--cluster-token-file");
  argv.push_back(token_file);
  auto r = run_command(argv, 120s);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(output_ids(r), expected()) << r.err;
  auto s0 = r.err.find("plan: stage 0: ");
  auto s1 = r.err.find("plan: stage 1: ");
  EXPECT_NE(s0, std::string::npos) << r.err;
  EXPECT_NE(s1, std::string::npos) << r.err;
  if (s0 != std::string::npos && s1 != std::string::npos) {
    auto node_of = [&](size_t at) {
      at += 15;
      return r.err.substr(at, r.err.find(' ', at) - at);
    };
    EXPECT_NE(node_of(s0), node_of(s1)) << "the stages share a node: " << r.err;
  }
  if (net.ok()) {
    run_command({bin("tessera"), "stop", "--temp-dir", root_b, "--timeout", "5"});
    run_command({bin("tessera"), "stop", "--temp-dir", root_a, "--timeout", "5"});
    fs::remove_all(root_a);
    fs::remove_all(root_b);
  }
}

// Rendezvous faults: the ranks of a -tp 2 group through a local node whose files live under a
// root of the test's; one rank is stopped (never joins) or killed as soon as it exists.
class RendezvousTest : public DistributedTest {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/tessera-rdv-XXXXXX";
    root_ = ::mkdtemp(tmpl);
  }
  void TearDown() override { fs::remove_all(root_); }

  // Starts the generate, waits for its second actor process and sends it `sig`; the generate's
  // exit status and how long it took.
  std::pair<CommandResult, std::chrono::milliseconds> fault(int sig) {
    std::vector<std::string> argv = {bin("tessera")};
    for (const auto& a : generate_args()) argv.push_back(a);
    for (std::string a : {"-tp", "2", "--nccl-init-timeout", "4"}) argv.push_back(a);
    auto t0 = std::chrono::steady_clock::now();
    BackgroundProcess p(argv, {"TESSERA_TMPDIR=" + root_});
    int victim = -1;
    wait_until(
        [&] {
          auto daemons = processes_matching("--temp-dir " + root_ + "/local-");
          if (daemons.size() != 1) return false;
          auto actors = testing::children_of(daemons[0]);
          if (actors.size() < 2) return false;
          // Both serve: the driver is preparing their collectives and loading (the rendezvous).
          std::string logs = testing::read_logs(root_, "actor-");
          size_t serving = 0;
          for (size_t at = logs.find("serving on port"); at != std::string::npos;
               at = logs.find("serving on port", at + 1)) {
            ++serving;
          }
          if (serving < 2) return false;
          victim = *std::max_element(actors.begin(), actors.end());
          return true;
        },
        60s);
    EXPECT_GT(victim, 0) << "the actors never started: " << p.err();
    if (victim > 0) ::kill(victim, sig);
    int status = p.wait(90s);
    auto took = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::chrono::steady_clock::now() - t0);
    CommandResult r;
    r.exit_code = status >= 0 && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.err = p.err();
    r.out = p.out();
    if (victim > 0) {
      ::kill(victim, SIGCONT);
      EXPECT_TRUE(wait_until([&] { return !process_alive(victim); }, 20s))
          << "the faulty rank " << victim << " is still running";
    }
    EXPECT_TRUE(wait_until(
        [&] {
          for (int pid : processes_matching("tessera")) {
            if (cmdline_of(pid).find(root_) != std::string::npos) return false;
          }
          return true;
        },
        20s))
        << "a daemon or actor of the failed start-up is still running";
    return {r, took};
  }

  std::string root_;
};

TEST_F(RendezvousTest, ARankThatNeverJoinsFailsStartUpInBoundedTimeNamingIt) {
  auto [r, took] = fault(SIGSTOP);
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_LT(took, 60s) << r.err;
  // The error names the rank (its actor, node and role), whichever side noticed first.
  EXPECT_TRUE(r.err.find("rank 1: actor a-") != std::string::npos ||
              r.err.find("rank 1 ") != std::string::npos)
      << r.err;
  std::printf("[rendezvous] a stopped rank: exit %d after %lld ms: %s\n", r.exit_code,
              static_cast<long long>(took.count()),
              r.err.substr(r.err.rfind("tessera generate")).c_str());
}

TEST_F(RendezvousTest, ARankKilledDuringRendezvousFailsStartUpNamingIt) {
  auto [r, took] = fault(SIGKILL);
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_LT(took, 60s) << r.err;
  EXPECT_NE(r.err.find("actor a-"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("killed by signal 9"), std::string::npos) << r.err;
  std::printf("[rendezvous] a killed rank: exit %d after %lld ms: %s\n", r.exit_code,
              static_cast<long long>(took.count()),
              r.err.substr(r.err.rfind("tessera generate")).c_str());
}

}  // namespace
}  // namespace tessera
