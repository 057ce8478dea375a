// `tessera generate` end to end: the CLI starts a local node (a head daemon), spawns a CPU actor,
// loads a tiny seeded checkpoint there and generates — checked against transformers' goldens.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>

#include "tests/integration/test_cluster.h"

namespace tessera {
namespace {

using testing::bin;
using testing::CommandResult;
using testing::run_command;

std::string source(const std::string& rel) { return std::string(TESSERA_SOURCE_DIR) + "/" + rel; }

class GenerateTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = std::filesystem::temp_directory_path() / ("tessera-gen-" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir_);
    std::ifstream in(source("tests/assets/goldens/model_llama.json"));
    golden_ = nlohmann::json::parse(in);
    auto r =
        run_command({bin("tessera"), "make-model", "--arch", "llama", "--preset", "tiny",
                     "--tokenizer", source("tests/assets/tokenizers/llama3"), "--seed",
                     std::to_string(golden_["seed"].get<int>()), "--dtype", "bf16", "--out", dir_});
    ASSERT_EQ(r.exit_code, 0) << r.err << " (run scripts/fetch-test-assets?)";
  }
  static void TearDownTestSuite() { std::filesystem::remove_all(dir_); }

  static nlohmann::json generate(std::vector<std::string> args, CommandResult* raw = nullptr) {
    std::vector<std::string> argv = {bin("tessera"), "generate", "--model", dir_,
                                     "--device",     "cpu",      "--json"};
    argv.insert(argv.end(), args.begin(), args.end());
    CommandResult r = run_command(argv);
    if (raw != nullptr) *raw = r;
    if (r.exit_code != 0) return nullptr;
    // The JSON object is the last line of stdout.
    std::string out = r.out;
    while (!out.empty() && out.back() == '\n') out.pop_back();
    return nlohmann::json::parse(out.substr(out.rfind('\n') + 1));
  }

  static inline std::string dir_;
  static inline nlohmann::json golden_;
};

TEST_F(GenerateTest, GreedyMatchesTransformers) {
  for (const auto& c : golden_["cases"]) {
    CommandResult raw;
    auto j = generate({"--prompt", c["prompt"].get<std::string>(), "--temperature", "0",
                       "--ignore-eos", "--max-tokens", "12"},
                      &raw);
    ASSERT_FALSE(j.is_null()) << raw.err;
    EXPECT_EQ(j["prompt_ids"], c["ids"]);
    std::vector<int> expected = c["greedy"].get<std::vector<int>>();
    expected.resize(12);
    EXPECT_EQ(j["output_ids"].get<std::vector<int>>(), expected) << c["prompt"];
    EXPECT_EQ(j["finish_reason"], "length");
  }
}

TEST_F(GenerateTest, SeededSamplingIsReproducibleAndLogprobsComeBack) {
  std::vector<std::string> args = {
      "--prompt", "Once upon a time", "--temperature", "1.0", "--top-p", "0.9", "--max-tokens",
      "8",        "--ignore-eos",     "--logprobs",    "3"};
  auto a1 = args, a2 = args, b = args;
  a1.insert(a1.end(), {"--seed", "42"});
  a2.insert(a2.end(), {"--seed", "42"});
  b.insert(b.end(), {"--seed", "43"});
  auto r1 = generate(a1), r2 = generate(a2), r3 = generate(b);
  ASSERT_FALSE(r1.is_null());
  ASSERT_FALSE(r3.is_null());
  EXPECT_EQ(r1["output_ids"], r2["output_ids"]);
  EXPECT_NE(r1["output_ids"], r3["output_ids"]);
  ASSERT_EQ(r1["logprobs"].size(), 8u);
  for (const auto& lp : r1["logprobs"]) {
    EXPECT_EQ(lp["top"].size(), 3u);
    EXPECT_LE(lp["logprob"].get<double>(), 0.0);
    // Alternatives come best first.
    EXPECT_GE(lp["top"][0][1].get<double>(), lp["top"][2][1].get<double>());
  }
}

// --async-scheduling: each decode step goes out before the token it takes is known, and the
// actor fills it in from its own sample (with tensor parallelism, the ranks that do not sample
// get it from the one that does). Greedy tokens still equal transformers', on one rank and on
// two; seeded sampling with penalties (which read the actor's token history), without them, and
// a stop string gives what one step at a time gives; a pipeline of stages is refused up front.
TEST_F(GenerateTest, AsyncSchedulingGivesTheSameTokens) {
  for (const auto& c : golden_["cases"]) {
    for (const char* tp : {"1", "2"}) {
      CommandResult raw;
      auto j = generate({"--prompt", c["prompt"].get<std::string>(), "--temperature", "0",
                         "--ignore-eos", "--max-tokens", "12", "--async-scheduling", "-tp", tp},
                        &raw);
      ASSERT_FALSE(j.is_null()) << raw.err;
      std::vector<int> expected = c["greedy"].get<std::vector<int>>();
      expected.resize(12);
      EXPECT_EQ(j["output_ids"].get<std::vector<int>>(), expected) << c["prompt"] << " tp " << tp;
    }
  }
  const std::vector<std::string> sampled = {
      "--prompt", "Once upon a time", "--prompt", "1, 2, 3,", "--temperature", "0.8", "--seed",
      "7",        "--max-tokens",     "16",       "--stop",   " the"};
  auto run = [&](std::vector<std::string> extra) {
    std::vector<std::string> argv = {bin("tessera"), "generate", "--model", dir_,
                                     "--device",     "cpu",      "--json"};
    argv.insert(argv.end(), sampled.begin(), sampled.end());
    argv.insert(argv.end(), extra.begin(), extra.end());
    return run_command(argv);
  };
  auto lines = [](const std::string& out) {
    std::vector<nlohmann::json> v;
    std::istringstream in(out);
    for (std::string line; std::getline(in, line);) {
      if (!line.empty() && line[0] == '{') v.push_back(nlohmann::json::parse(line));
    }
    return v;
  };
  const std::vector<std::vector<std::string>> setups = {
      {"--repetition-penalty", "1.3"}, {"-tp", "2", "--repetition-penalty", "1.3"}, {"-tp", "2"}};
  for (const auto& setup : setups) {
    std::vector<std::string> async = setup;
    async.push_back("--async-scheduling");
    CommandResult one = run(setup), two = run(async);
    ASSERT_EQ(one.exit_code, 0) << one.err;
    ASSERT_EQ(two.exit_code, 0) << two.err;
    auto a = lines(one.out), b = lines(two.out);
    ASSERT_EQ(a.size(), 2u) << one.out;
    ASSERT_EQ(b.size(), 2u) << two.out;
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(b[i]["output_ids"], a[i]["output_ids"]) << i << " " << setup[1];
      EXPECT_EQ(b[i]["text"], a[i]["text"]) << i;
      EXPECT_EQ(b[i]["finish_reason"], a[i]["finish_reason"]) << i;
    }
  }
  CommandResult pp2 = run_command({bin("tessera"), "generate", "--model", dir_, "--device", "cpu",
                                   "--prompt", "hi", "-pp", "2", "--async-scheduling"});
  EXPECT_NE(pp2.exit_code, 0);
  EXPECT_NE(pp2.err.find("--async-scheduling needs pipeline parallel size 1"), std::string::npos)
      << pp2.err;
}

TEST_F(GenerateTest, StopStringEndsTheOutputBeforeIt) {
  auto full = generate({"--prompt", "The capital of France is", "--temperature", "0",
                        "--ignore-eos", "--max-tokens", "16"});
  ASSERT_FALSE(full.is_null());
  std::string text = full["text"];
  ASSERT_GT(text.size(), 12u);
  std::string stop = text.substr(text.size() / 2, 3);
  auto cut = generate({"--prompt", "The capital of France is", "--temperature", "0", "--ignore-eos",
                       "--max-tokens", "16", "--stop", stop});
  ASSERT_FALSE(cut.is_null());
  EXPECT_EQ(cut["finish_reason"], "stop");
  EXPECT_EQ(cut["text"].get<std::string>(), text.substr(0, text.find(stop)));
}

TEST_F(GenerateTest, BadInputIsAClearErrorAndNonZeroExit) {
  CommandResult r;
  // A prompt longer than the context.
  EXPECT_TRUE(generate({"--prompt", "one two three four five six seven eight nine ten",
                        "--max-model-len", "4"},
                       &r)
                  .is_null());
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("max-model-len is 4"), std::string::npos) << r.err;
  // Bad sampling values.
  EXPECT_TRUE(generate({"--prompt", "hi", "--top-p", "1.5"}, &r).is_null());
  EXPECT_NE(r.err.find("top_p must be in (0, 1]"), std::string::npos) << r.err;

  // A truncated checkpoint names the file.
  std::string broken = dir_ + "-broken";
  std::filesystem::remove_all(broken);
  std::filesystem::copy(dir_, broken);
  std::filesystem::resize_file(broken + "/model.safetensors",
                               std::filesystem::file_size(broken + "/model.safetensors") / 2);
  r = run_command({bin("tessera"), "generate", "--model", broken, "--prompt", "hi"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("model.safetensors"), std::string::npos) << r.err;

  // An architecture we do not run is refused with the supported list.
  std::filesystem::copy_file(dir_ + "/model.safetensors", broken + "/model.safetensors",
                             std::filesystem::copy_options::overwrite_existing);
  std::ifstream in(broken + "/config.json");
  auto config = nlohmann::json::parse(in);
  in.close();
  config["architectures"] = {"QWenLMHeadModel"};
  std::ofstream(broken + "/config.json") << config.dump(2);
  r = run_command({bin("tessera"), "generate", "--model", broken, "--prompt", "hi"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("QWenLMHeadModel"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("LlamaForCausalLM"), std::string::npos) << r.err;
  std::filesystem::remove_all(broken);
}

// Several prompts run as one batch; each prompt's greedy output is what it gets alone.
TEST_F(GenerateTest, SeveralPromptsAreBatchedAndEachMatchesItsOwnRun) {
  const std::vector<std::string> prompts = {"The capital of France is", "Once upon a time",
                                            "1, 2, 3,"};
  std::vector<std::string> argv = {
      bin("tessera"), "generate",      "--model", dir_,           "--device",     "cpu",
      "--json",       "--temperature", "0",       "--ignore-eos", "--max-tokens", "10"};
  for (const auto& p : prompts) {
    argv.push_back("--prompt");
    argv.push_back(p);
  }
  CommandResult r = run_command(argv);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::vector<nlohmann::json> lines;
  std::istringstream out(r.out);
  for (std::string line; std::getline(out, line);) {
    if (!line.empty() && line[0] == '{') lines.push_back(nlohmann::json::parse(line));
  }
  ASSERT_EQ(lines.size(), prompts.size()) << r.out;
  EXPECT_NE(r.err.find("3 prompt(s)"), std::string::npos) << r.err;
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto alone = generate(
        {"--prompt", prompts[i], "--temperature", "0", "--ignore-eos", "--max-tokens", "10"});
    ASSERT_FALSE(alone.is_null());
    EXPECT_EQ(lines[i]["prompt_ids"], alone["prompt_ids"]) << prompts[i];
    EXPECT_EQ(lines[i]["output_ids"], alone["output_ids"]) << prompts[i];
    EXPECT_EQ(lines[i]["output_ids"].size(), 10u);
  }
}

// --device picks the backend: an unknown name is a usage error (exit 2, like every flag checked
// while the command line is parsed); cuda either runs on the node's GPU or,
// where there is none (CI), fails saying so, never falling back silently.
TEST_F(GenerateTest, DeviceFlagIsHonoured) {
  CommandResult r = run_command({bin("tessera"), "generate", "--model", dir_, "--device", "tpu",
                                 "--prompt", "hi", "--max-tokens", "2"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--device 'tpu' is not one of auto, cuda, cpu"), std::string::npos) << r.err;
  r = run_command({bin("tessera"), "generate", "--model", dir_, "--device", "cuda", "--prompt",
                   "hi", "--max-tokens", "2", "--gpu-memory-utilization", "0.2"});
  if (r.exit_code == 0) {
    EXPECT_NE(r.err.find("cuda backend"), std::string::npos) << r.err;
  } else {
    EXPECT_EQ(r.exit_code, 1);
    EXPECT_TRUE(r.err.find("has no GPU") != std::string::npos ||
                r.err.find("built without CUDA") != std::string::npos)
        << r.err;
  }
  r = run_command({bin("tessera"), "generate", "--model", dir_, "--device", "cpu", "--prompt", "hi",
                   "--max-tokens", "2"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("cpu backend"), std::string::npos) << r.err;
}

// --dtype half on the cpu backend runs, and says once that it computes in float32 (the model
// as vLLM's positional, too); the model's own dtype (auto) says nothing.
TEST_F(GenerateTest, HalfOnTheCpuBackendSaysItComputesInFloat32) {
  const std::string note = "--dtype half: the CPU backend computes in float32";
  CommandResult half = run_command({bin("tessera"), "generate", dir_, "--device", "cpu", "--dtype",
                                    "half", "--prompt", "hi", "--max-tokens", "2"});
  ASSERT_EQ(half.exit_code, 0) << half.err;
  const size_t at = half.err.find(note);
  EXPECT_NE(at, std::string::npos) << half.err;
  EXPECT_EQ(half.err.find(note, at + 1), std::string::npos) << half.err;  // once
  EXPECT_NE(half.err.find("cpu backend, F32"), std::string::npos) << half.err;
  CommandResult plain = run_command({bin("tessera"), "generate", "--model", dir_, "--device", "cpu",
                                     "--prompt", "hi", "--max-tokens", "2"});
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  EXPECT_EQ(plain.err.find("the CPU backend computes in float32"), std::string::npos) << plain.err;
}

// --kv-cache-dtype fp8 on the cpu backend: the actor stores E4M3-rounded K/V (the log says so;
// kernels_cpu_test checks the rounding, cuda_model_test the GPU against this backend) and
// decodes deterministically. The tokens are not compared with the bf16 goldens: the tiny random
// model's K/V (~0.1) lose ~6% to E4M3 and its near-flat logits flip. An unsupported value is
// refused before anything starts.
TEST_F(GenerateTest, Fp8KvCacheRunsDeterministically) {
  const auto& c = golden_["cases"][0];
  const std::vector<std::string> args = {"--prompt",
                                         c["prompt"].get<std::string>(),
                                         "--temperature",
                                         "0",
                                         "--ignore-eos",
                                         "--max-tokens",
                                         "12",
                                         "--kv-cache-dtype",
                                         "fp8"};
  CommandResult raw;
  auto fp8 = generate(args, &raw);
  ASSERT_FALSE(fp8.is_null()) << raw.err;
  EXPECT_NE(raw.err.find("KV cache F8_E4M3"), std::string::npos) << raw.err;
  const std::vector<int> got = fp8["output_ids"].get<std::vector<int>>();
  ASSERT_EQ(got.size(), 12u);
  auto again = generate(args, &raw);
  ASSERT_FALSE(again.is_null()) << raw.err;
  EXPECT_EQ(again["output_ids"].get<std::vector<int>>(), got);
  auto full = generate({"--prompt", c["prompt"].get<std::string>(), "--max-tokens", "1"}, &raw);
  ASSERT_FALSE(full.is_null()) << raw.err;
  EXPECT_NE(raw.err.find("KV cache F32"), std::string::npos) << raw.err;

  CommandResult r = run_command({bin("tessera"), "generate", "--model", dir_, "--device", "cpu",
                                 "--prompt", "hi", "--kv-cache-dtype", "fp8_e5m2"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("E5M2 is not supported"), std::string::npos) << r.err;
}

// The user's path for a quantized checkpoint: make-model writes an AWQ one, generate reads the
// method from its quantization_config (or the agreeing flag, vLLM's awq_marlin spelling too),
// and refuses a contradicting flag naming both; plan sizes its int4 weights.
TEST_F(GenerateTest, AnAwqCheckpointRunsAndAContradictingFlagIsRefused) {
  const std::string awq = dir_ + "-awq";
  std::filesystem::remove_all(awq);
  auto made = run_command({bin("tessera"), "make-model", "--arch", "llama", "--preset", "tiny",
                           "--intermediate-size", "192", "--tokenizer",
                           source("tests/assets/tokenizers/llama3"), "--quantization", "awq",
                           "--group-size", "32", "--out", awq});
  ASSERT_EQ(made.exit_code, 0) << made.err;
  auto run = [&](std::vector<std::string> extra) {
    std::vector<std::string> argv = {bin("tessera"), "generate", "--model", awq, "--device",
                                     "cpu", "--prompt", "The capital of France is",
                                     "--temperature", "0", "--ignore-eos", "--max-tokens", "6",
                                     "--json"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return run_command(argv);
  };
  CommandResult a = run({});
  ASSERT_EQ(a.exit_code, 0) << a.err;
  EXPECT_NE(a.err.find("weights awq (4-bit, group 32)"), std::string::npos) << a.err;
  CommandResult b = run({"--quantization", "awq_marlin"});
  ASSERT_EQ(b.exit_code, 0) << b.err;
  EXPECT_EQ(a.out, b.out) << "the same method, the same tokens";
  CommandResult c = run({"-q", "gptq"});
  EXPECT_NE(c.exit_code, 0);
  EXPECT_NE(c.err.find("--quantization gptq contradicts the checkpoint, which is awq"),
            std::string::npos)
      << c.err;
  CommandResult d = run({"--quantization", "int4"});
  EXPECT_NE(d.exit_code, 0);
  EXPECT_NE(d.err.find("--quantization int4 is not supported"), std::string::npos) << d.err;
  CommandResult p = run_command({bin("tessera"), "plan", "--model", awq, "--device", "cpu"});
  EXPECT_EQ(p.exit_code, 0) << p.err;
  EXPECT_NE(p.out.find("linear layers awq (4-bit, group 32)"), std::string::npos) << p.out;
  std::filesystem::remove_all(awq);
}

// `tessera bench latency` (vLLM's meaning) on the CPU backend: warm-up iterations are not
// measured, every measured one is, and the percentiles are ordered and within the measured range.
TEST_F(GenerateTest, BenchLatencyMeasuresEveryIterationOfOneBatch) {
  const std::string json = dir_ + "-latency.json";
  CommandResult r =
      run_command({bin("tessera"), "bench", "latency", "--model", dir_, "--device", "cpu",
                   "--batch-size", "3", "--input-len", "12", "--output-len", "5",
                   "--num-iters-warmup", "2", "--num-iters", "4", "--output-json", json});
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  EXPECT_NE(r.out.find("Avg latency: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("99% percentile latency: "), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("warm-up iteration 2 of 2"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("measured iteration 4 of 4"), std::string::npos) << r.err;
  std::ifstream in(json);
  ASSERT_TRUE(in) << json;
  auto j = nlohmann::json::parse(in);
  EXPECT_EQ(j["backend"], "cpu");
  EXPECT_EQ(j["batch_size"], 3);
  ASSERT_EQ(j["latencies"].size(), 4u) << j.dump();
  double lo = 1e9, hi = 0, sum = 0;
  for (const auto& l : j["latencies"]) {
    lo = std::min(lo, l.get<double>());
    hi = std::max(hi, l.get<double>());
    sum += l.get<double>();
  }
  EXPECT_GT(lo, 0.0);
  EXPECT_NEAR(j["avg_latency"].get<double>(), sum / 4, 1e-9);
  double prev = lo;
  for (const char* q : {"10", "25", "50", "75", "90", "99"}) {
    const double v = j["percentiles"][q].get<double>();
    EXPECT_GE(v, prev) << q;
    EXPECT_LE(v, hi) << q;
    prev = v;
  }
  std::filesystem::remove(json);

  // --json: the same result on stdout, the text on stderr.
  CommandResult as_json =
      run_command({bin("tessera"), "bench", "latency", "--model", dir_, "--device", "cpu",
                   "--batch-size", "2", "--input-len", "8", "--output-len", "3",
                   "--num-iters-warmup", "0", "--num-iters", "2", "--json"});
  ASSERT_EQ(as_json.exit_code, 0) << as_json.err;
  auto parsed = nlohmann::json::parse(as_json.out, nullptr, false);
  ASSERT_FALSE(parsed.is_discarded()) << as_json.out;
  EXPECT_EQ(parsed["latencies"].size(), 2u);
  EXPECT_EQ(parsed["batch_size"], 2);
  EXPECT_NE(as_json.err.find("Avg latency: "), std::string::npos) << as_json.err;

  CommandResult bad = run_command({bin("tessera"), "bench", "latency", "--model", dir_, "--device",
                                   "cpu", "--batch-size", "0"});
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("--batch-size must be at least 1"), std::string::npos) << bad.err;
}

// `tessera bench control-plane` with two CPU ranks: empty steps round trip through the rings and
// through RPCs, every measured step counted, the percentiles ordered; a bad transport is refused.
TEST_F(GenerateTest, BenchControlPlaneTimesEmptyStepsOverRingsAndRpc) {
  for (const std::string transport : {"ring", "rpc"}) {
    const std::string json = dir_ + "-control-" + transport + ".json";
    CommandResult r =
        run_command({bin("tessera"), "bench", "control-plane", "--model", dir_, "--device", "cpu",
                     "-tp", "2", "--transport", transport, "--num-steps", "300", "--num-warmup",
                     "20", "--output-json", json});
    ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
    EXPECT_NE(r.out.find("2 rank(s)"), std::string::npos) << r.out;
    // A table: a header row of the statistics, then the round trip in us.
    const size_t header = r.out.find(" mean  ");
    ASSERT_NE(header, std::string::npos) << r.out;
    EXPECT_LT(header, r.out.find(" p99\n", header)) << r.out;
    const size_t row = r.out.find("  round trip  ");
    ASSERT_NE(row, std::string::npos) << r.out;
    EXPECT_LT(row, r.out.find("  us\n", row)) << r.out;
    std::ifstream in(json);
    ASSERT_TRUE(in) << json;
    auto j = nlohmann::json::parse(in);
    EXPECT_EQ(j["transport"], transport);
    EXPECT_EQ(j["world_size"], 2);
    EXPECT_EQ(j["num_steps"], 300);
    const double p50 = j["round_trip_us"]["p50"].get<double>();
    EXPECT_GT(p50, 0.0);
    EXPECT_LE(p50, j["round_trip_us"]["p90"].get<double>());
    EXPECT_LE(j["round_trip_us"]["p90"].get<double>(), j["round_trip_us"]["p99"].get<double>());
    EXPECT_LE(j["actor_us_p50"].get<double>(), p50);
    std::filesystem::remove(json);
  }
  CommandResult bad = run_command({bin("tessera"), "bench", "control-plane", "--model", dir_,
                                   "--device", "cpu", "--transport", "carrier-pigeon"});
  EXPECT_EQ(bad.exit_code, 2) << bad.err;
  EXPECT_NE(bad.err.find("--transport"), std::string::npos) << bad.err;
}

// `tessera bench report` on the CPU backend: every scenario runs and the JSON carries the
// figures, the step breakdown and the parameter count the roofline divides by.
TEST_F(GenerateTest, BenchReportWritesItsJson) {
  const std::string json = dir_ + "-bench.json";
  CommandResult r = run_command({bin("tessera"),
                                 "bench",
                                 "report",
                                 "--model",
                                 dir_,
                                 "--device",
                                 "cpu",
                                 "--input-len",
                                 "16",
                                 "--output-len",
                                 "6",
                                 "--num-iters",
                                 "1",
                                 "--num-iters-warmup",
                                 "0",
                                 "--prefill-len",
                                 "48",
                                 "--prefill-iters",
                                 "1",
                                 "--batch-size",
                                 "3",
                                 "--batch-iters",
                                 "1",
                                 "--output-json",
                                 json});
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  std::ifstream in(json);
  ASSERT_TRUE(in) << json;
  auto j = nlohmann::json::parse(in);
  EXPECT_EQ(j["backend"], "cpu");
  EXPECT_EQ(j["detokenize"], false);
  const auto& s = j["scenarios"];
  ASSERT_TRUE(s.contains("batch1_decode")) << s.dump();
  ASSERT_TRUE(s.contains("prefill_48")) << s.dump();
  ASSERT_TRUE(s.contains("batch3_decode")) << s.dump();
  EXPECT_GT(s["batch1_decode"]["decode_tok_s"][0].get<double>(), 0.0);
  EXPECT_GT(s["batch1_decode"]["ttft_ms"][0].get<double>(), 0.0);
  EXPECT_GT(s["batch1_decode"]["actor_execute_ms_median"].get<double>(), 0.0);
  EXPECT_LE(s["batch1_decode"]["actor_execute_ms_median"].get<double>(),
            s["batch1_decode"]["rpc_call_ms_median"].get<double>());
  EXPECT_GT(s["prefill_48"]["tok_s"].get<double>(), 0.0);
  // The prefill's own step: the actor's execute (its GPU forward inside it: 0 on the CPU
  // backend, which times none) inside the RPC call, inside the time to the first token.
  const auto& pf = s["prefill_48"];
  EXPECT_GT(pf["actor_execute_ms_median"].get<double>(), 0.0);
  EXPECT_GE(pf["gpu_forward_ms_median"].get<double>(), 0.0);
  EXPECT_LE(pf["gpu_forward_ms_median"].get<double>(), pf["actor_execute_ms_median"].get<double>());
  EXPECT_LE(pf["actor_execute_ms_median"].get<double>(), pf["rpc_call_ms_median"].get<double>());
  EXPECT_LE(pf["rpc_call_ms_median"].get<double>(), pf["best_ms"].get<double>() * 1.5);
  EXPECT_GT(s["batch3_decode"]["decode_tok_s"][0].get<double>(), 0.0);
  // Tiny llama: hidden 64, intermediate 176, 4 layers, 4 heads / 2 KV heads of 16, vocab 128256.
  const int64_t layer = 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 176 + 2 * 64;
  EXPECT_EQ(j["matmul_parameters"].get<int64_t>(), 4 * layer + 64 + 128256 * 64);
  EXPECT_EQ(j["decode_bytes_per_token"].get<int64_t>(), 4 * (4 * layer + 64 + 128256 * 64));
  std::filesystem::remove(json);
}

// `tessera bench throughput` on the CPU backend: random prompts and a JSONL dataset (text and
// token ids, per-request output lengths), every token counted, the JSON written; a bad dataset
// line is named.
TEST_F(GenerateTest, BenchThroughputCountsEveryTokenAndNamesBadData) {
  const std::string json = dir_ + "-throughput.json";
  CommandResult r = run_command({bin("tessera"), "bench", "throughput", "--model", dir_, "--device",
                                 "cpu", "--num-prompts", "12", "--input-len", "20", "--output-len",
                                 "5", "--output-json", json});
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  EXPECT_NE(r.out.find("output tokens/s"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("GPU forward passes"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("12 of 12 requests done"), std::string::npos) << r.err;
  std::ifstream in(json);
  ASSERT_TRUE(in) << json;
  auto j = nlohmann::json::parse(in);
  EXPECT_EQ(j["num_requests"], 12);
  EXPECT_EQ(j["input_tokens"], 12 * 20);
  EXPECT_EQ(j["output_tokens"], 12 * 5);
  EXPECT_GT(j["output_tokens_per_second"].get<double>(), 0.0);
  EXPECT_NEAR(j["output_tokens_per_second"].get<double>() * j["elapsed_s"].get<double>(), 60, 1e-6);
  EXPECT_EQ(j["command"].get<std::string>().find("bench throughput") != std::string::npos, true);
  // The timeline covers every step, ends with the run, and each step read at least the weights.
  const auto& timeline = j["timeline"];
  ASSERT_FALSE(timeline.empty()) << j.dump();
  size_t timeline_steps = 0;
  for (const auto& sample : timeline) {
    timeline_steps += sample["steps"].get<size_t>();
    EXPECT_GE(sample["min_bytes_per_step"].get<double>(), j["weight_bytes"].get<double>());
    EXPECT_GT(sample["step_ms"].get<double>(), 0.0);
  }
  EXPECT_EQ(timeline_steps, j["steps"].get<size_t>());
  EXPECT_NEAR(timeline.back()["t_s"].get<double>(), j["elapsed_s"].get<double>(), 0.05);
  EXPECT_EQ(timeline.back()["running"], 0);
  // Tiny llama: 4 layers x 2 KV heads x head_dim 16, K and V, fp32 on the CPU backend.
  EXPECT_EQ(j["kv_bytes_per_token"].get<double>(), 2.0 * 4 * 2 * 16 * 4);

  // With --async-scheduling two steps overlap: every token still counted, and the actor's time
  // per step is its own (two running steps are not counted twice), so it adds up to less than the
  // wall time.
  r = run_command({bin("tessera"), "bench", "throughput", "--model", dir_, "--device", "cpu",
                   "--num-prompts", "12", "--input-len", "20", "--output-len", "5",
                   "--async-scheduling", "--output-json", json});
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  EXPECT_NE(r.out.find("steps' submit to collect (overlapping)"), std::string::npos) << r.out;
  {
    std::ifstream async_in(json);
    auto a = nlohmann::json::parse(async_in);
    EXPECT_EQ(a["async_scheduling"], true);
    EXPECT_EQ(a["output_tokens"], 12 * 5);
    EXPECT_GT(a["actor_execute_s"].get<double>(), 0.0);
    EXPECT_LT(a["actor_execute_s"].get<double>(), a["elapsed_s"].get<double>());
  }

  const std::string data = dir_ + "-prompts.jsonl";
  std::ofstream(data) << "{\"prompt\": \"Hello there\"}\n\n"
                      << "{\"prompt_token_ids\": [100, 200, 300], \"output_len\": 3}\n";
  r = run_command({bin("tessera"), "bench", "throughput", "--model", dir_, "--device", "cpu",
                   "--dataset-path", data, "--output-len", "4", "--output-json", json});
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  std::ifstream in2(json);
  j = nlohmann::json::parse(in2);
  EXPECT_EQ(j["num_requests"], 2);
  EXPECT_EQ(j["output_tokens"], 4 + 3);

  std::ofstream(data) << "{\"prompt\": \"fine\"}\n{\"prompt_token_ids\": [1, -2]}\n";
  r = run_command({bin("tessera"), "bench", "throughput", "--model", dir_, "--device", "cpu",
                   "--dataset-path", data});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find(data + ":2: prompt_token_ids holds -2"), std::string::npos) << r.err;
}

// Offline batches: --input JSONL (text or token ids) to --output JSONL, in order, each line the
// same as that prompt's own run; a bad line is an error naming it.
TEST_F(GenerateTest, JsonlInputGivesJsonlOutputInOrder) {
  const std::string in = dir_ + "/prompts.jsonl", out = dir_ + "/results.jsonl";
  std::vector<int> ids = golden_["cases"][0]["ids"].get<std::vector<int>>();
  {
    std::ofstream f(in);
    f << nlohmann::json{{"prompt", "Once upon a time"}}.dump() << "\n\n"
      << nlohmann::json{{"prompt_token_ids", ids}}.dump() << "\n";
  }
  CommandResult r =
      run_command({bin("tessera"), "generate", "--model", dir_, "--device", "cpu", "--input", in,
                   "--output", out, "--temperature", "0", "--ignore-eos", "--max-tokens", "12"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::ifstream f(out);
  std::vector<nlohmann::json> lines;
  for (std::string line; std::getline(f, line);) lines.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0]["prompt"], "Once upon a time");
  auto alone = generate(
      {"--prompt", "Once upon a time", "--temperature", "0", "--ignore-eos", "--max-tokens", "12"});
  EXPECT_EQ(lines[0]["output_ids"], alone["output_ids"]);
  std::vector<int> want = golden_["cases"][0]["greedy"].get<std::vector<int>>();
  want.resize(12);
  EXPECT_EQ(lines[1]["prompt_ids"].get<std::vector<int>>(), ids);
  EXPECT_EQ(lines[1]["output_ids"].get<std::vector<int>>(), want);  // transformers' tokens
  {
    std::ofstream bad(in);
    bad << "{\"prompt\": \"ok\"}\n{\"text\": 3}\n";
  }
  r = run_command({bin("tessera"), "generate", "--model", dir_, "--device", "cpu", "--input", in});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("prompts.jsonl line 2"), std::string::npos) << r.err;
}

// The offline C++ API's example program (driver/examples/offline_inference.cpp): four prompts
// batched, each the completion `tessera generate` gives it.
TEST_F(GenerateTest, TheOfflineApiExampleRuns) {
  CommandResult r =
      run_command({bin("tessera-example-offline"), dir_, "--device", "cpu", "--greedy"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  auto one = generate(
      {"--prompt", "The capital of France is", "--temperature", "0", "--max-tokens", "16"});
  ASSERT_FALSE(one.is_null());
  const std::string line = "Prompt: \"The capital of France is\", Generated text: \"" +
                           one["text"].get<std::string>() + "\"";
  EXPECT_NE(r.out.find(line), std::string::npos) << r.out;
  size_t prompts = 0;
  for (size_t at = r.out.find("Prompt: "); at != std::string::npos;
       at = r.out.find("Prompt: ", at + 1)) {
    ++prompts;
  }
  EXPECT_EQ(prompts, 4u) << r.out;
}

// Prompts are text: ill-formed UTF-8 on the command line or in --input is refused, naming the
// prompt and the byte, before a node starts (it used to become U+FFFD, or "not a JSON object").
TEST_F(GenerateTest, APromptThatIsNotUtf8IsRefusedNamingTheByte) {
  CommandResult r;
  EXPECT_TRUE(generate({"--prompt", "fine", "--prompt",
                        "ab\xff\xfe"
                        "cd"},
                       &r)
                  .is_null());
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("prompt 2 is not valid UTF-8 at byte 2 (0xff)"), std::string::npos) << r.err;
  // A truncated sequence at the end; U+FFFD written out is fine.
  EXPECT_TRUE(generate({"--prompt", "\xEF\xBF\xBD ok \xE2\x82"}, &r).is_null());
  EXPECT_NE(r.err.find("prompt 1 is not valid UTF-8 at byte 7"), std::string::npos) << r.err;

  const std::string in = dir_ + "/not-utf8.jsonl";
  {
    std::ofstream f(in, std::ios::binary);
    f << "{\"prompt\": \"ok\"}\n\n{\"prompt\": \"ab\xff\xfe"
         "cd\"}\n";
  }
  r = run_command({bin("tessera"), "generate", "--model", dir_, "--device", "cpu", "--input", in});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find("not-utf8.jsonl line 3: prompt 2 is not valid UTF-8 at byte 14"),
            std::string::npos)
      << r.err;
  EXPECT_EQ(r.err.find("not a JSON object"), std::string::npos) << r.err;
}

// "replica I ran N request(s)" lines of a -dp run's stderr: N by replica I.
std::map<int, int> requests_by_replica(const std::string& err) {
  std::map<int, int> ran;
  const std::regex line("replica (\\d+) ran (\\d+) request");
  for (std::sregex_iterator it(err.begin(), err.end(), line), end; it != end; ++it) {
    ran[std::stoi((*it)[1])] = std::stoi((*it)[2]);
  }
  return ran;
}

// -dp 2 (vLLM's LLM(data_parallel_size=2)): the prompts are spread over two replicas of the model
// on one local node. Each prompt's greedy output is the one -dp 1 gives, in the prompts' order,
// and each replica says how many requests it ran: both ran some.
TEST_F(GenerateTest, DataParallelGivesEveryPromptItsOwnOutputAndUsesBothReplicas) {
  std::vector<std::string> argv = {
      bin("tessera"), "generate",      "--model", dir_,           "--device",     "cpu",
      "--json",       "--temperature", "0",       "--ignore-eos", "--max-tokens", "8"};
  const std::vector<std::string> prompts = {"The capital of France is", "Once upon a time",
                                            "1, 2, 3,", "def fibonacci(n):"};
  for (const auto& p : prompts) argv.insert(argv.end(), {"--prompt", p});
  auto run = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = argv;
    a.insert(a.end(), extra.begin(), extra.end());
    return run_command(a, std::chrono::seconds(120));
  };
  auto lines = [](const std::string& out) {
    std::vector<nlohmann::json> v;
    std::istringstream in(out);
    for (std::string line; std::getline(in, line);) {
      if (!line.empty() && line[0] == '{') v.push_back(nlohmann::json::parse(line));
    }
    return v;
  };
  CommandResult one = run({}), two = run({"-dp", "2"});
  ASSERT_EQ(one.exit_code, 0) << one.err;
  ASSERT_EQ(two.exit_code, 0) << two.err;
  auto a = lines(one.out), b = lines(two.out);
  ASSERT_EQ(a.size(), prompts.size()) << one.out;
  ASSERT_EQ(b.size(), prompts.size()) << two.out;
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(b[i]["prompt_ids"], a[i]["prompt_ids"]) << prompts[i];
    EXPECT_EQ(b[i]["output_ids"], a[i]["output_ids"]) << prompts[i];
    EXPECT_EQ(b[i]["text"], a[i]["text"]) << prompts[i];
  }
  EXPECT_NE(two.err.find("4 prompt(s)"), std::string::npos) << two.err;
  const std::map<int, int> ran = requests_by_replica(two.err);
  ASSERT_EQ(ran.size(), 2u) << two.err;
  EXPECT_GE(ran.at(0), 1) << two.err;
  EXPECT_GE(ran.at(1), 1) << two.err;
  EXPECT_EQ(ran.at(0) + ran.at(1), 4) << two.err;
  EXPECT_TRUE(requests_by_replica(one.err).empty()) << one.err;  // -dp 1: the one engine
}

// `bench throughput -dp 2` (vLLM's --data-parallel-size): every request added at once to two
// replicas; the JSON has the replicas' count and what each ran, which adds up to the totals.
TEST_F(GenerateTest, BenchThroughputOverReplicasReportsWhatEachRan) {
  const std::string json = dir_ + "-throughput-dp.json";
  CommandResult r = run_command({bin("tessera"), "bench", "throughput", "--model", dir_, "--device",
                                 "cpu", "-dp", "2", "--router", "least_load", "--num-prompts", "8",
                                 "--input-len", "20", "--output-len", "4", "--output-json", json},
                                std::chrono::seconds(120));
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  EXPECT_NE(r.out.find("output tokens/s"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("router least_load"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("8 of 8 requests done"), std::string::npos) << r.err;
  std::ifstream in(json);
  ASSERT_TRUE(in) << json;
  auto j = nlohmann::json::parse(in);
  EXPECT_EQ(j["data_parallel_size"], 2);
  EXPECT_EQ(j["router"], "least_load");
  EXPECT_EQ(j["num_requests"], 8);
  EXPECT_EQ(j["input_tokens"], 8 * 20);
  EXPECT_EQ(j["output_tokens"], 8 * 4);
  EXPECT_GT(j["output_tokens_per_second"].get<double>(), 0.0);
  ASSERT_EQ(j["replicas"].size(), 2u) << j.dump();
  int requests = 0, input_tokens = 0, output_tokens = 0;
  for (const auto& replica : j["replicas"]) {
    EXPECT_GE(replica["requests"].get<int>(), 1) << j.dump();
    requests += replica["requests"].get<int>();
    input_tokens += replica["input_tokens"].get<int>();
    output_tokens += replica["output_tokens"].get<int>();
  }
  EXPECT_EQ(requests, 8);
  EXPECT_EQ(input_tokens, 8 * 20);
  EXPECT_EQ(output_tokens, 8 * 4);
}

// The tiny mixture-of-experts models (make-model --preset tiny) generate on the CPU backend, and
// the same greedy tokens when their experts are split over two tensor-parallel ranks.
TEST(GenerateMoeTest, TinyMoeModelsGenerateAndTensorParallelAgrees) {
  for (auto [arch, tokenizer] :
       {std::pair{"mixtral", "llama2"}, {"qwen2_moe", "qwen3"}, {"qwen3_moe", "qwen3"}}) {
    const std::string dir = std::filesystem::temp_directory_path() /
                            ("tessera-gen-" + std::string(arch) + "-" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir);
    auto made =
        run_command({bin("tessera"), "make-model", "--arch", arch, "--preset", "tiny",
                     "--tokenizer", source("tests/assets/tokenizers/" + std::string(tokenizer)),
                     "--seed", "1234", "--dtype", "bf16", "--out", dir});
    ASSERT_EQ(made.exit_code, 0) << arch << ": " << made.err;
    std::vector<std::vector<int>> outputs;
    for (std::vector<std::string> split : {std::vector<std::string>{}, {"-tp", "2"}}) {
      std::vector<std::string> argv = {bin("tessera"),
                                       "generate",
                                       "--model",
                                       dir,
                                       "--device",
                                       "cpu",
                                       "--json",
                                       "--prompt",
                                       "The capital of France is",
                                       "--temperature",
                                       "0",
                                       "--ignore-eos",
                                       "--max-tokens",
                                       "8"};
      argv.insert(argv.end(), split.begin(), split.end());
      CommandResult r = run_command(argv);
      ASSERT_EQ(r.exit_code, 0) << arch << " " << (split.empty() ? "tp 1" : "tp 2") << ": "
                                << r.err;
      std::string out = r.out;
      while (!out.empty() && out.back() == '\n') out.pop_back();
      auto j = nlohmann::json::parse(out.substr(out.rfind('\n') + 1));
      outputs.push_back(j["output_ids"].get<std::vector<int>>());
      EXPECT_EQ(outputs.back().size(), 8u) << arch;
      EXPECT_EQ(j["finish_reason"], "length") << arch;
    }
    EXPECT_EQ(outputs[0], outputs[1]) << arch << ": -tp 2 gives other greedy tokens";
    std::filesystem::remove_all(dir);
  }
}

// A mixture-of-experts model in real actor processes, -tp 2 with and without
// --enable-expert-parallel (whole experts per rank, tokens by all-to-all over the tcp
// collectives): the same greedy text either way, and `bench throughput` reports the expert
// balance, the same routings either way (every prompt token and every decoded one top_k times).
TEST(ExpertParallelTest, GeneratesAsTensorParallelAndReportsTheExpertBalance) {
  const std::string dir =
      std::filesystem::temp_directory_path() / ("tessera-ep-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  auto made = run_command({bin("tessera"), "make-model", "--arch", "qwen3_moe", "--preset", "tiny",
                           "--tokenizer", source("tests/assets/tokenizers/qwen3"), "--seed", "7",
                           "--out", dir});
  ASSERT_EQ(made.exit_code, 0) << made.err;
  auto text = [&](bool ep) {
    std::vector<std::string> argv = {bin("tessera"),  "generate",
                                     "--model",       dir,
                                     "--device",      "cpu",
                                     "-tp",           "2",
                                     "--prompt",      "The rivers of Europe",
                                     "--max-tokens",  "12",
                                     "--temperature", "0"};
    if (ep) argv.push_back("--enable-expert-parallel");
    CommandResult r = run_command(argv, std::chrono::seconds(120));
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return r.out;
  };
  const std::string tp = text(false);
  EXPECT_FALSE(tp.empty());
  EXPECT_EQ(text(true), tp);

  std::map<bool, nlohmann::json> loads;
  for (bool ep : {false, true}) {
    const std::string json = dir + (ep ? "-ep.json" : "-tp.json");
    std::vector<std::string> argv = {
        bin("tessera"), "bench",        "throughput", "--model",       dir, "--device",
        "cpu",          "-tp",          "2",          "--num-prompts", "6", "--input-len",
        "24",           "--output-len", "6",          "--output-json", json};
    if (ep) argv.push_back("--enable-expert-parallel");
    CommandResult r = run_command(argv, std::chrono::seconds(120));
    ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
    EXPECT_NE(r.out.find("Expert balance: "), std::string::npos) << r.out;
    std::ifstream in(json);
    auto j = nlohmann::json::parse(in);
    EXPECT_EQ(j["enable_expert_parallel"], ep);
    const auto& load = j["expert_load"];
    ASSERT_TRUE(load.is_object()) << j.dump();
    EXPECT_EQ(load["num_experts"], 4);
    EXPECT_EQ(load["steps"], j["steps"]);
    ASSERT_EQ(load["layers"].size(), 2u) << load.dump();  // the tiny model's MoE layers
    for (const auto& layer : load["layers"]) {
      uint64_t routings = 0;
      for (uint64_t n : layer["tokens_per_expert"].get<std::vector<uint64_t>>()) routings += n;
      // 6 prompts of 24 tokens, then 5 decode steps each (the 6th token comes from the last),
      // top 2 experts per token.
      EXPECT_EQ(routings, 2u * (6 * 24 + 6 * 5)) << layer.dump();
      EXPECT_GE(layer["max_over_mean"].get<double>(), 1.0);
    }
    EXPECT_GE(load["max_over_mean"].get<double>(), load["mean_max_over_mean"].get<double>());
    loads[ep] = load;
    std::filesystem::remove(json);
  }
  EXPECT_EQ(loads[true]["layers"], loads[false]["layers"]) << "the same routings either way";
  std::filesystem::remove_all(dir);
}

// Gemma 2, Gemma 3 and Phi-3 (make-model --preset tiny) in real actor processes: a prompt longer
// than their windows (8 / 8 / 16 tokens) and 16 greedy tokens past it give the same tokens on one
// rank, at -tp 2 (Phi-3's fused projections sliced per part) and at -pp 2.
TEST(GenerateSlidingWindowTest, GemmaAndPhi3GenerateAlikeOnEveryLayout) {
  for (const char* arch : {"gemma2", "gemma3", "phi3"}) {
    const std::string dir = std::filesystem::temp_directory_path() /
                            ("tessera-gen-" + std::string(arch) + "-" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir);
    auto made = run_command({bin("tessera"), "make-model", "--arch", arch, "--preset", "tiny",
                             "--tokenizer", source("tests/assets/tokenizers/llama2"), "--seed",
                             "1234", "--dtype", "bf16", "--out", dir});
    ASSERT_EQ(made.exit_code, 0) << arch << ": " << made.err;
    std::vector<std::vector<int>> outputs;
    for (std::vector<std::string> split :
         {std::vector<std::string>{}, {"-tp", "2"}, {"-pp", "2"}}) {
      std::vector<std::string> argv = {
          bin("tessera"),
          "generate",
          "--model",
          dir,
          "--device",
          "cpu",
          "--json",
          "--prompt",
          "Once upon a time, in a village at the edge of a great forest, there lived a clockmaker",
          "--temperature",
          "0",
          "--ignore-eos",
          "--max-tokens",
          "16"};
      argv.insert(argv.end(), split.begin(), split.end());
      CommandResult r = run_command(argv);
      ASSERT_EQ(r.exit_code, 0) << arch << " " << (split.empty() ? "one rank" : split[0]) << ": "
                                << r.err;
      std::string out = r.out;
      while (!out.empty() && out.back() == '\n') out.pop_back();
      auto j = nlohmann::json::parse(out.substr(out.rfind('\n') + 1));
      EXPECT_GT(j["prompt_ids"].size(), 16u) << "the prompt is longer than the windows";
      outputs.push_back(j["output_ids"].get<std::vector<int>>());
    }
    ASSERT_EQ(outputs[0].size(), 16u) << arch;
    EXPECT_EQ(outputs[1], outputs[0]) << arch << " -tp 2";
    EXPECT_EQ(outputs[2], outputs[0]) << arch << " -pp 2";
    std::filesystem::remove_all(dir);
  }
}

}  // namespace
}  // namespace tessera
