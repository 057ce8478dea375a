#include "driver/server/bench_router.h"

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <vector>

#include "driver/bench.h"

namespace tessera::server {

CLI::App* add_bench_router_subcommand(CLI::App& bench, BenchRouterOptions& o) {
  auto* cmd = bench.add_subcommand(
      "router", "The -dp router's decision time with many cached prefixes per replica");
  cmd->add_option("--replicas", o.replicas, "Replicas (4)")->check(CLI::Range(1u, 1024u));
  cmd->add_option("--prefixes", o.prefixes, "Cached prefixes per replica (10000)");
  cmd->add_option("--prefix-len", o.prefix_len, "Tokens of each prefix (1024)");
  cmd->add_option("--tail-len", o.tail_len, "Tokens after the prefix (64)");
  cmd->add_option("--decisions", o.decisions, "Decisions timed (20000)")
      ->check(CLI::Range(1u, 10000000u));
  cmd->add_option("--block-size", o.block_size, "Tokens per KV block (16)")
      ->check(CLI::Range(1u, 1024u));
  cmd->add_option_function<std::string>(
      "--router",
      [&o](const std::string& text) {
        auto p = parse_router_policy(text);
        if (!p) throw CLI::ValidationError(p.status().message());
        o.policy = *p;
      },
      "prefix (default) | least_load | round_robin");
  cmd->add_option("--seed", o.seed, "The prompts' random seed (0)");
  cmd->add_option("--output-json", o.output_json, "Write the results as JSON here");
  cmd->footer("Example: tessera bench router --replicas 4 --prefixes 10000");
  return cmd;
}

namespace {

std::vector<int32_t> random_tokens(std::mt19937_64& rng, uint32_t n) {
  std::vector<int32_t> t(n);
  for (int32_t& v : t) v = static_cast<int32_t>(rng() % 128000);
  return t;
}

}  // namespace

int bench_router_command(const BenchRouterOptions& o) {
  const size_t blocks_per_prefix = (o.prefix_len + o.block_size - 1) / o.block_size;
  const size_t capacity = static_cast<size_t>(o.prefixes) * (blocks_per_prefix + 1) + 1024;
  Router router(o.policy, o.replicas, o.block_size, capacity);
  std::vector<ReplicaLoad> load(o.replicas);
  std::mt19937_64 rng(o.seed);
  // Fill the mirrors: every replica gets `prefixes` distinct prefixes (round robin over the
  // least loaded replica spreads them evenly).
  std::vector<std::vector<int32_t>> prefixes;
  const auto fill0 = std::chrono::steady_clock::now();
  for (uint64_t i = 0; i < uint64_t{o.prefixes} * o.replicas; ++i) {
    prefixes.push_back(random_tokens(rng, o.prefix_len));
    router.route(prefixes.back(), load);
  }
  const double fill_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - fill0).count();
  size_t cached = 0;
  for (uint32_t r = 0; r < o.replicas; ++r) cached += router.cached_blocks(r);
  std::fprintf(stderr,
               "router %s: %u replicas, %zu cached blocks (%u prefixes of %u tokens each), "
               "filled in %.1f s\n",
               router_policy_name(o.policy), o.replicas, cached, o.prefixes, o.prefix_len, fill_s);
  std::vector<double> us;
  us.reserve(o.decisions);
  size_t hits = 0;
  for (uint32_t i = 0; i < o.decisions; ++i) {
    std::vector<int32_t> prompt = prefixes[rng() % prefixes.size()];
    const std::vector<int32_t> tail = random_tokens(rng, o.tail_len);
    prompt.insert(prompt.end(), tail.begin(), tail.end());
    const auto t0 = std::chrono::steady_clock::now();
    auto d = router.route(prompt, load);
    us.push_back(
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    hits += d && d->matched_tokens > 0;
  }
  const double p50 = percentile(us, 50), p90 = percentile(us, 90), p99 = percentile(us, 99);
  std::printf(
      "routing decision: p50 %.2f us, p90 %.2f us, p99 %.2f us over %u decisions of "
      "%u-token prompts; %.1f%% found their prefix\n",
      p50, p90, p99, o.decisions, o.prefix_len + o.tail_len,
      100.0 * static_cast<double>(hits) / o.decisions);
  if (!o.output_json.empty()) {
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    nlohmann::json j = {{"command", o.command_line},
                        {"hostname", host},
                        {"router", router_policy_name(o.policy)},
                        {"replicas", o.replicas},
                        {"prefixes_per_replica", o.prefixes},
                        {"prefix_len", o.prefix_len},
                        {"tail_len", o.tail_len},
                        {"cached_blocks", cached},
                        {"decisions", o.decisions},
                        {"decision_us", {{"p50", p50}, {"p90", p90}, {"p99", p99}}},
                        {"prefix_found_fraction", static_cast<double>(hits) / o.decisions}};
    std::ofstream out(o.output_json);
    out << j.dump(2) << "\n";
    if (!out) {
      std::fprintf(stderr, "tessera bench router: cannot write %s\n", o.output_json.c_str());
      return 1;
    }
  }
  return 0;
}

}  // namespace tessera::server
