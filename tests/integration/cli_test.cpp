// The command line as a new user meets it: --version and `version`, tessera's own flags on
// either side of the subcommand, the nearest valid name for a typo, an example at the end of
// every --help, progress on a non-terminal at the default log level, and the cluster found from
// TESSERA_ADDRESS or from the temp dir the last `tessera start --temp-dir` used.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "tests/integration/test_cluster.h"

namespace tessera {
namespace {

using namespace std::chrono_literals;
using testing::bin;
using testing::CommandResult;
using testing::run_command;
using testing::TestCluster;
namespace fs = std::filesystem;

std::string source(const std::string& rel) { return std::string(TESSERA_SOURCE_DIR) + "/" + rel; }

std::string fresh_dir() {
  char tmpl[] = "/tmp/tessera-cli-XXXXXX";
  return ::mkdtemp(tmpl);
}

TEST(CliTest, VersionEitherWay) {
  CommandResult flag = run_command({bin("tessera"), "--version"});
  CommandResult sub = run_command({bin("tessera"), "version"});
  ASSERT_EQ(flag.exit_code, 0) << flag.err;
  ASSERT_EQ(sub.exit_code, 0) << sub.err;
  EXPECT_EQ(flag.out, sub.out);
  EXPECT_EQ(flag.out.rfind("tessera ", 0), 0u) << flag.out;
  EXPECT_NE(flag.out.find("(protocol v"), std::string::npos) << flag.out;
}

// --log-level before or after the subcommand: info shows make-model's info line, the default
// (warn) does not, and the default still shows the weights' progress summary.
TEST(CliTest, TesseraFlagsOnEitherSideOfTheSubcommandAndProgressByDefault) {
  const std::string dir = fresh_dir();
  auto make = [&](const std::vector<std::string>& before, const std::vector<std::string>& after) {
    fs::remove_all(dir + "/m");
    std::vector<std::string> argv = {bin("tessera")};
    argv.insert(argv.end(), before.begin(), before.end());
    for (std::string a : {"make-model", "--arch", "llama", "--preset", "tiny", "--tokenizer"}) {
      argv.push_back(a);
    }
    argv.push_back(source("tests/assets/tokenizers/llama3"));
    argv.push_back("--out");
    argv.push_back(dir + "/m");
    argv.insert(argv.end(), after.begin(), after.end());
    return run_command(argv, 120s);
  };
  const std::string info_line = "make-model: llama tiny (LlamaForCausalLM";
  const std::string summary = "make-model: writing weights: ";
  CommandResult first = make({"--log-level", "info"}, {});
  ASSERT_EQ(first.exit_code, 0) << first.err;
  EXPECT_NE(first.err.find(info_line), std::string::npos) << first.err;
  CommandResult last = make({}, {"--log-level", "info"});
  ASSERT_EQ(last.exit_code, 0) << last.err;
  EXPECT_NE(last.err.find(info_line), std::string::npos) << last.err;
  CommandResult plain = make({}, {});
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  EXPECT_EQ(plain.err.find(info_line), std::string::npos) << plain.err;
  EXPECT_NE(plain.err.find(summary), std::string::npos) << plain.err;
  EXPECT_NE(plain.err.find(" in 1 file(s)"), std::string::npos) << plain.err;
  CommandResult quiet = make({}, {"--log-level", "error"});
  ASSERT_EQ(quiet.exit_code, 0) << quiet.err;
  EXPECT_EQ(quiet.err.find(summary), std::string::npos) << quiet.err;
  fs::remove_all(dir);
}

TEST(CliTest, ATypoGetsTheNearestValidName) {
  struct Case {
    std::vector<std::string> args;
    std::string hint;
  };
  const std::vector<Case> cases = {
      {{"generate", "--model", "/nowhere", "--max-model-length", "5"}, "'--max-model-len'"},
      {{"generat", "--model", "/nowhere"}, "'generate'"},
      {{"bench", "throughpt"}, "'throughput'"},
      {{"status", "--jsn"}, "'--json'"},
      {{"serve", "/nowhere", "--tensor-paralel-size", "2"}, "'--tensor-parallel-size'"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> argv = {bin("tessera")};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    CommandResult r = run_command(argv);
    EXPECT_EQ(r.exit_code, 2) << c.args[0] << ": " << r.err;
    EXPECT_NE(r.err.find("did you mean " + c.hint), std::string::npos) << r.err;
  }
  // Nothing near: no suggestion, only CLI11's message.
  CommandResult far = run_command({bin("tessera"), "status", "--completely-different"});
  EXPECT_EQ(far.exit_code, 2);
  EXPECT_EQ(far.err.find("did you mean"), std::string::npos) << far.err;
}

TEST(CliTest, EveryHelpEndsWithAnExample) {
  const std::vector<std::vector<std::string>> commands = {{"start"},
                                                          {"stop"},
                                                          {"status"},
                                                          {"generate"},
                                                          {"bench"},
                                                          {"bench", "latency"},
                                                          {"bench", "report"},
                                                          {"bench", "throughput"},
                                                          {"bench", "serve"},
                                                          {"bench", "control-plane"},
                                                          {"make-model"},
                                                          {"topo"},
                                                          {"plan"},
                                                          {"serve"},
                                                          {"version"}};
  for (const auto& c : commands) {
    std::vector<std::string> argv = {bin("tessera")};
    argv.insert(argv.end(), c.begin(), c.end());
    argv.push_back("--help");
    CommandResult r = run_command(argv);
    const std::string name = c.size() > 1 ? c[0] + " " + c[1] : c[0];
    EXPECT_EQ(r.exit_code, 0) << name << ": " << r.err;
    const size_t at = r.out.find("\nExample");
    ASSERT_NE(at, std::string::npos) << name << ":\n" << r.out;
    EXPECT_NE(r.out.find("  tessera " + c[0], at), std::string::npos) << name << ":\n" << r.out;
  }
}

// The command lines of vLLM's tutorials parse as they are: the model as --model or positional
// (after tessera's own flags too), --trust-remote-code on every model command with one line
// saying that no code of the model's runs. The model is not there, so each fails at config.json
// (exit 1), after the flags were taken (2 would be bad usage).
TEST(CliTest, VllmTutorialCommandLinesAreAccepted) {
  const std::string trust = "--trust-remote-code: Tessera executes no code from the model";
  // The tutorial's serve line, word for word but for the model.
  std::vector<std::string> line = {bin("tessera")};
  std::istringstream words(
      "serve --host 0.0.0.0 --port 8080 --model /nowhere --tensor-parallel-size 4 --dtype half "
      "--gpu-memory-utilization 0.9 --max-model-len 32768 --quantization awq "
      "--enable-auto-tool-choice --tool-call-parser hermes --trust-remote-code");
  for (std::string w; words >> w;) line.push_back(w);
  CommandResult serve = run_command(line);
  EXPECT_EQ(serve.exit_code, 1) << serve.err;
  EXPECT_TRUE(serve.err.find("/nowhere/config.json") != std::string::npos ||
              serve.err.find("cannot listen on 0.0.0.0:8080") != std::string::npos)
      << serve.err;
  EXPECT_NE(serve.err.find(trust), std::string::npos) << serve.err;
  const std::vector<std::vector<std::string>> commands = {{"serve"},
                                                          {"generate"},
                                                          {"plan"},
                                                          {"bench", "latency"},
                                                          {"bench", "throughput"},
                                                          {"bench", "report"},
                                                          {"bench", "control-plane"}};
  for (const auto& command : commands) {
    for (bool positional : {true, false}) {
      std::vector<std::string> argv = {bin("tessera"), "--log-level", "info"};
      argv.insert(argv.end(), command.begin(), command.end());
      if (!positional) argv.push_back("--model");
      argv.push_back("/nowhere");
      argv.push_back("--trust-remote-code");
      if (command[0] == "generate") argv.insert(argv.end(), {"--prompt", "hi"});
      CommandResult r = run_command(argv);
      const std::string name =
          command.back() + (positional ? " MODEL" : " --model MODEL") + ": " + r.err;
      EXPECT_EQ(r.exit_code, 1) << name;
      EXPECT_NE(r.err.find("/nowhere/config.json"), std::string::npos) << name;
      EXPECT_NE(r.err.find(trust), std::string::npos) << name;
    }
  }
}

// A head started with --temp-dir is found by `tessera status` and `tessera stop` with no flags
// (through the current_root the start left in the default root), and by TESSERA_ADDRESS from
// anywhere; with neither, status says how to point it at a cluster.
TEST(CliTest, CommandsFindTheClusterFromTheEnvironmentOrTheLastStart) {
  TestCluster cluster;  // its root is the --temp-dir; the default roots are fresh folders
  const std::string home = fresh_dir(), elsewhere = fresh_dir();
  CommandResult started =
      cluster.tessera({"start", "--head", "--port", "0", "--temp-dir", cluster.root()}, 60s,
                      {"TESSERA_TMPDIR=" + home});
  ASSERT_EQ(started.exit_code, 0) << started.err;
  std::string address;
  std::ifstream(cluster.root() + "/head_address") >> address;
  ASSERT_FALSE(address.empty());
  EXPECT_NE(started.out.find("export TESSERA_ADDRESS=" + address), std::string::npos)
      << started.out;

  CommandResult found = cluster.tessera({"status"}, 60s, {"TESSERA_TMPDIR=" + home});
  EXPECT_EQ(found.exit_code, 0) << found.err;
  EXPECT_NE(found.out.find("Cluster at " + address), std::string::npos) << found.out;

  CommandResult by_env =
      cluster.tessera({"status", "--json"}, 60s,
                      {"TESSERA_TMPDIR=" + elsewhere, "TESSERA_ADDRESS=" + address,
                       "TESSERA_CLUSTER_TOKEN=" + cluster.token()});
  EXPECT_EQ(by_env.exit_code, 0) << by_env.err;
  EXPECT_NE(by_env.out.find(address), std::string::npos) << by_env.out;

  CommandResult lost = cluster.tessera({"status"}, 60s, {"TESSERA_TMPDIR=" + elsewhere});
  EXPECT_EQ(lost.exit_code, 1);
  EXPECT_NE(lost.err.find("TESSERA_ADDRESS"), std::string::npos) << lost.err;

  CommandResult stopped = cluster.tessera({"stop"}, 60s, {"TESSERA_TMPDIR=" + home});
  EXPECT_EQ(stopped.exit_code, 0) << stopped.err;
  CommandResult after = cluster.tessera({"status"}, 60s, {"TESSERA_TMPDIR=" + home});
  EXPECT_NE(after.exit_code, 0) << after.out;
  // A TESSERA_ADDRESS left over from the stopped cluster: the error says where the address
  // came from and what to do, beside the missing token.
  CommandResult stale =
      cluster.tessera({"status"}, 60s, {"TESSERA_TMPDIR=" + home, "TESSERA_ADDRESS=" + address});
  EXPECT_EQ(stale.exit_code, 1) << stale.out;
  EXPECT_NE(stale.err.find("comes from $TESSERA_ADDRESS"), std::string::npos) << stale.err;
  EXPECT_NE(stale.err.find("unset TESSERA_ADDRESS"), std::string::npos) << stale.err;
  fs::remove_all(home);
  fs::remove_all(elsewhere);
}

// -dp takes N >= 1 or auto on `generate` and `bench throughput` (as on serve and plan): 0 is a
// usage error naming the flag, before any model is read; `bench latency` (one batch) has no -dp.
TEST(CliTest, DataParallelSizeIsCheckedWhereItIsTaken) {
  for (const std::vector<std::string>& command :
       {std::vector<std::string>{"generate", "--prompt", "hi"},
        std::vector<std::string>{"bench", "throughput"}}) {
    for (const std::string dp : {"-dp", "--data-parallel-size"}) {
      std::vector<std::string> argv = {bin("tessera")};
      argv.insert(argv.end(), command.begin(), command.end());
      argv.insert(argv.end(), {"--model", "/nowhere", dp, "0"});
      CommandResult r = run_command(argv);
      EXPECT_EQ(r.exit_code, 2) << command[0] << " " << dp << ": " << r.err;
      EXPECT_NE(r.err.find("-dp/--data-parallel-size must be a positive integer or auto, got '0'"),
                std::string::npos)
          << r.err;
      EXPECT_EQ(r.err.find("/nowhere"), std::string::npos) << r.err;
    }
  }
  CommandResult latency =
      run_command({bin("tessera"), "bench", "latency", "--model", "/nowhere", "-dp", "2"});
  EXPECT_EQ(latency.exit_code, 2) << latency.err;
  EXPECT_NE(latency.err.find("--data-parallel-size"), std::string::npos) << latency.err;
}

}  // namespace
}  // namespace tessera
