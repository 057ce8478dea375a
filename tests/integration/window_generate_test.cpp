// `tessera generate` with a sliding-window model end to end on the CPU backend: a tiny Mistral
// whose config.json says "sliding_window": 8 generates a sequence several times longer than its
// whole KV cache (--num-gpu-blocks-override 4: 64 tokens), because the driver's block manager
// frees the blocks that fall out of the window; the tokens are those of a run with a cache that
// holds the whole sequence. Without the window the same small cache is refused, naming the flag.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/integration/test_cluster.h"

namespace tessera {
namespace {

using testing::bin;
using testing::CommandResult;
using testing::run_command;

std::string source(const std::string& rel) { return std::string(TESSERA_SOURCE_DIR) + "/" + rel; }

// A tiny Mistral (make-model --preset tiny, seed 1234) with config.json's sliding_window set
// (null: none).
std::string make_mistral(const std::string& tag, const nlohmann::json& sliding_window) {
  const std::string dir = std::filesystem::temp_directory_path() /
                          ("tessera-window-gen-" + tag + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  CommandResult made = run_command({bin("tessera"), "make-model", "--arch", "mistral", "--preset",
                                    "tiny", "--tokenizer", source("tests/assets/tokenizers/llama2"),
                                    "--seed", "1234", "--dtype", "bf16", "--out", dir});
  EXPECT_EQ(made.exit_code, 0) << made.err;
  std::ifstream in(dir + "/config.json");
  nlohmann::json config = nlohmann::json::parse(in);
  in.close();
  config["sliding_window"] = sliding_window;
  std::ofstream(dir + "/config.json") << config.dump(2);
  return dir;
}

const char* kPrompt =
    "Once upon a time, in a village at the edge of a great forest, there lived an old clockmaker "
    "who repaired every clock in the valley.";

// `tessera generate --json` on the CPU backend: the JSON line, or null on failure (raw keeps the
// process's output).
nlohmann::json generate(const std::string& dir, std::vector<std::string> args, CommandResult* raw) {
  std::vector<std::string> argv = {
      bin("tessera"),    "generate", "--model",       dir, "--device",     "cpu",          "--json",
      "--prompt",        kPrompt,    "--temperature", "0", "--ignore-eos", "--max-tokens", "200",
      "--max-model-len", "512"};
  argv.insert(argv.end(), args.begin(), args.end());
  *raw = run_command(argv);
  if (raw->exit_code != 0) return nullptr;
  std::string out = raw->out;
  while (!out.empty() && out.back() == '\n') out.pop_back();
  return nlohmann::json::parse(out.substr(out.rfind('\n') + 1));
}

TEST(SlidingWindowGenerateTest, ALongGenerationRunsInACacheSmallerThanTheSequence) {
  const std::string dir = make_mistral("swa", 8);
  CommandResult raw;
  // A cache for the whole sequence (the CPU backend's default: max-model-len's blocks).
  const nlohmann::json full = generate(dir, {}, &raw);
  ASSERT_FALSE(full.is_null()) << raw.err;
  const std::vector<int> expected = full["output_ids"].get<std::vector<int>>();
  ASSERT_EQ(expected.size(), 200u);
  const size_t total = full["prompt_ids"].size() + expected.size();
  // 4 blocks of 16 tokens, a step budget of 16 (chunked prefill across the window edge): the
  // sequence is about 4x the cache.
  const nlohmann::json small =
      generate(dir, {"--num-gpu-blocks-override", "4", "--max-num-batched-tokens", "16"}, &raw);
  ASSERT_FALSE(small.is_null()) << raw.err;
  EXPECT_GT(total, 3u * 64u);
  EXPECT_EQ(small["output_ids"].get<std::vector<int>>(), expected)
      << "the blocks freed out of the window change nothing";
  EXPECT_EQ(small["finish_reason"], "length");
  std::filesystem::remove_all(dir);
}

TEST(SlidingWindowGenerateTest, WithoutAWindowTheSmallCacheIsRefusedNamingTheFlag) {
  const std::string dir = make_mistral("full", nullptr);
  CommandResult raw;
  const nlohmann::json j = generate(dir, {"--num-gpu-blocks-override", "4"}, &raw);
  EXPECT_TRUE(j.is_null());
  EXPECT_NE(raw.exit_code, 0);
  EXPECT_NE(raw.err.find("--num-gpu-blocks-override"), std::string::npos) << raw.err;
  std::filesystem::remove_all(dir);
}

// A window larger than the context is a clear error naming the field.
TEST(SlidingWindowGenerateTest, AWindowLargerThanTheContextIsAnErrorNamingTheField) {
  const std::string dir = make_mistral("too-wide", 1 << 20);
  CommandResult raw;
  const nlohmann::json j = generate(dir, {}, &raw);
  EXPECT_TRUE(j.is_null());
  EXPECT_NE(raw.exit_code, 0);
  EXPECT_NE(raw.err.find("sliding_window"), std::string::npos) << raw.err;
  EXPECT_NE(raw.err.find("max_position_embeddings"), std::string::npos) << raw.err;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tessera
