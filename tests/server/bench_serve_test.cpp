// `tessera bench serve` (driver/server/bench_serve.h): vLLM's prefix_repetition dataset, the
// dataset flags' checks, the reading of a server's /metrics (from the text our server's own
// metrics code writes), and whole runs: against a real `tessera serve -dp 2` on a tiny CPU
// model (the cache and replica figures in the JSON), and against a server that has no /metrics.
#include "driver/server/bench_serve.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "driver/server/metrics.h"
#include "driver/server/replica_set.h"
#include "tests/integration/test_cluster.h"

namespace tessera::server {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::BackgroundProcess;
using testing::bin;
using testing::CommandResult;
using testing::run_command;
using testing::wait_until;
using namespace std::chrono_literals;

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::vector<int32_t> head(const BenchPrompt& p, size_t n) {
  return {p.ids.begin(), p.ids.begin() + static_cast<std::ptrdiff_t>(n)};
}

TEST(BenchServeTest, PrefixRepetitionSharesEachPrefixAndShufflesTheOrder) {
  PrefixRepetitionOptions p;
  p.prefix_len = 16;
  p.suffix_len = 5;
  p.num_prefixes = 3;
  p.output_len = 7;
  auto got = prefix_repetition_prompts(20, p, 5);
  ASSERT_TRUE(got.has_value()) << got.status().message();
  ASSERT_EQ(got->size(), 20u);
  std::map<std::vector<int32_t>, int> per_prefix;
  std::set<std::vector<int32_t>> suffixes;
  std::vector<std::vector<int32_t>> order;
  for (const BenchPrompt& b : *got) {
    ASSERT_EQ(b.ids.size(), 21u);
    EXPECT_EQ(b.output_len, 7u);
    EXPECT_TRUE(b.text.empty());
    for (int32_t id : b.ids) {
      EXPECT_GE(id, 100);
      EXPECT_LT(id, 32000);
    }
    per_prefix[head(b, 16)]++;
    suffixes.insert({b.ids.begin() + 16, b.ids.end()});
    order.push_back(head(b, 16));
  }
  // 20 over 3 prefixes: 7, 7 and 6 requests each, every suffix its own.
  std::multiset<int> counts;
  for (const auto& [prefix, n] : per_prefix) counts.insert(n);
  EXPECT_EQ(counts, (std::multiset<int>{6, 7, 7}));
  EXPECT_EQ(suffixes.size(), 20u);
  // Shuffled: in generation order the prefix would change twice; here the repeats are spread.
  int changes = 0;
  for (size_t i = 1; i < order.size(); ++i) changes += order[i] != order[i - 1];
  EXPECT_GT(changes, 6);
  std::set<std::vector<int32_t>> first_half(order.begin(), order.begin() + 10);
  EXPECT_EQ(first_half.size(), 3u);

  // The same seed gives the same prompts in the same order; another seed others.
  auto again = prefix_repetition_prompts(20, p, 5);
  auto other = prefix_repetition_prompts(20, p, 6);
  ASSERT_TRUE(again.has_value() && other.has_value());
  for (size_t i = 0; i < 20; ++i) EXPECT_EQ((*again)[i].ids, (*got)[i].ids) << i;
  EXPECT_NE((*other)[0].ids, (*got)[0].ids);

  // The issue's workload: 64 prompts of 1,000 tokens, 8 users' 50-token questions each.
  p = {1000, 50, 64, 128};
  auto big = prefix_repetition_prompts(512, p, 1);
  ASSERT_TRUE(big.has_value());
  per_prefix.clear();
  for (const BenchPrompt& b : *big) {
    EXPECT_EQ(b.ids.size(), 1050u);
    per_prefix[head(b, 1000)]++;
  }
  EXPECT_EQ(per_prefix.size(), 64u);
  for (const auto& [prefix, n] : per_prefix) EXPECT_EQ(n, 8);

  // No prefix: every prompt its own; no suffix: the prefixes alone.
  p = {0, 8, 2, 4};
  auto bare = prefix_repetition_prompts(6, p, 1);
  ASSERT_TRUE(bare.has_value());
  std::set<std::vector<int32_t>> distinct;
  for (const BenchPrompt& b : *bare) distinct.insert(b.ids);
  EXPECT_EQ(distinct.size(), 6u);
  p = {8, 0, 2, 4};
  auto only = prefix_repetition_prompts(6, p, 1);
  ASSERT_TRUE(only.has_value());
  distinct.clear();
  for (const BenchPrompt& b : *only) distinct.insert(b.ids);
  EXPECT_EQ(distinct.size(), 2u);
}

// Each bad combination is refused before any request, naming its flag.
TEST(BenchServeTest, BadDatasetFlagsAreRefusedNamingTheFlag) {
  auto refused = [](const BenchServeOptions& o) {
    auto got = bench_serve_prompts(o);
    EXPECT_FALSE(got.has_value());
    return got ? std::string() : got.status().message();
  };
  BenchServeOptions o;
  o.dataset = BenchServeDataset::kPrefixRepetition;
  o.num_prompts = 8;
  o.prefix_repetition.num_prefixes = 0;
  EXPECT_TRUE(contains(refused(o), "--prefix-repetition-num-prefixes must be at least 1"));
  o.prefix_repetition.num_prefixes = 9;
  std::string why = refused(o);
  EXPECT_TRUE(contains(why, "--num-prompts 8")) << why;
  EXPECT_TRUE(contains(why, "--prefix-repetition-num-prefixes 9")) << why;
  o.prefix_repetition = {0, 0, 2, 16};
  why = refused(o);
  EXPECT_TRUE(contains(why, "--prefix-repetition-prefix-len")) << why;
  EXPECT_TRUE(contains(why, "--prefix-repetition-suffix-len")) << why;
  o.prefix_repetition = {16, 0, 2, 0};
  EXPECT_TRUE(contains(refused(o), "--prefix-repetition-output-len"));
  o.prefix_repetition = {};
  o.dataset_path = "/tmp/prompts.jsonl";
  EXPECT_TRUE(
      contains(refused(o), "--dataset-path /tmp/prompts.jsonl is for --dataset-name custom"));
  o.dataset = BenchServeDataset::kCustom;
  o.dataset_path.clear();
  EXPECT_TRUE(contains(refused(o), "--dataset-name custom needs --dataset-path"));
  o.dataset.reset();
  o.num_prompts = 0;
  EXPECT_TRUE(contains(refused(o), "--num-prompts must be at least 1"));
  o.num_prompts = 4;
  o.input_len = 0;
  EXPECT_TRUE(contains(refused(o), "--input-len must be at least 1"));

  // The defaults: random without --dataset-path, custom with it; vLLM's prefix_repetition
  // defaults.
  BenchServeOptions d;
  EXPECT_EQ(*bench_serve_dataset(d), BenchServeDataset::kRandom);
  d.dataset_path = "x.jsonl";
  EXPECT_EQ(*bench_serve_dataset(d), BenchServeDataset::kCustom);
  EXPECT_EQ(d.prefix_repetition.prefix_len, 256u);
  EXPECT_EQ(d.prefix_repetition.suffix_len, 256u);
  EXPECT_EQ(d.prefix_repetition.num_prefixes, 10u);
  EXPECT_EQ(d.prefix_repetition.output_len, 128u);
}

TEST(BenchServeTest, TheFlagsSetTheOptions) {
  auto parse = [](const std::string& line, BenchServeOptions& o) {
    CLI::App app;
    CLI::App* bench = app.add_subcommand("bench");
    add_bench_serve_subcommand(*bench, o);
    app.parse("bench serve " + line, false);
  };
  BenchServeOptions o;
  parse(
      "--dataset-name prefix_repetition --prefix-repetition-prefix-len 1000 "
      "--prefix-repetition-suffix-len 50 --prefix-repetition-num-prefixes 64 "
      "--prefix-repetition-output-len 100 --num-prompts 512 --request-rate 16",
      o);
  EXPECT_EQ(o.dataset, BenchServeDataset::kPrefixRepetition);
  EXPECT_EQ(o.prefix_repetition.prefix_len, 1000u);
  EXPECT_EQ(o.prefix_repetition.suffix_len, 50u);
  EXPECT_EQ(o.prefix_repetition.num_prefixes, 64u);
  EXPECT_EQ(o.prefix_repetition.output_len, 100u);
  EXPECT_EQ(o.request_rate, 16.0);
  BenchServeOptions bad;
  try {
    parse("--dataset-name sharegpt", bad);
    ADD_FAILURE() << "--dataset-name sharegpt was taken";
  } catch (const CLI::ValidationError& e) {
    EXPECT_TRUE(contains(e.what(), "--dataset-name")) << e.what();
    EXPECT_TRUE(contains(e.what(), "prefix_repetition")) << e.what();
  }
}

// Two snapshots of a -dp 2 server's /metrics as our metrics code writes them.
std::string dp_metrics(uint64_t q, uint64_t h, uint64_t routed0, uint64_t routed1, int decisions) {
  EngineStats s;
  s.prefix_cache_queries = q;
  s.prefix_cache_hits = h;
  std::vector<ReplicaView> replicas(2);
  replicas[0].routed = routed0;
  replicas[1].routed = routed1;
  replicas[0].stats.prefix_cache_queries = q / 2;
  replicas[0].stats.prefix_cache_hits = h / 2;
  replicas[1].stats.prefix_cache_queries = q - q / 2;
  replicas[1].stats.prefix_cache_hits = h - h / 2;
  Histogram routing({0.001, 0.01});
  for (int i = 0; i < decisions; ++i) routing.observe(0.002);
  return prometheus(Metrics{}, s, "tiny") + replica_prometheus(true, replicas, routing, "tiny");
}

TEST(BenchServeTest, TheFiguresOfOurMetricsText) {
  auto before = parse_server_metrics(dp_metrics(100, 20, 3, 5, 8));
  ASSERT_TRUE(before.has_value()) << before.status().message();
  EXPECT_TRUE(before->tessera);
  EXPECT_EQ(before->prefix_cache_queries, 100);
  EXPECT_EQ(before->prefix_cache_hits, 20);
  EXPECT_EQ(before->routed, (std::map<uint32_t, double>{{0, 3}, {1, 5}}));
  EXPECT_EQ(before->router_decisions, 8);
  EXPECT_NEAR(before->router_decision_seconds, 0.016, 1e-12);
  auto after = parse_server_metrics(dp_metrics(1100, 620, 13, 35, 48));
  ASSERT_TRUE(after.has_value());
  auto f = server_cache_figures(*before, *after);
  ASSERT_TRUE(f.has_value()) << f.status().message();
  EXPECT_EQ(f->prefix_cache_queries, 1000);
  EXPECT_EQ(f->prefix_cache_hits, 600);
  EXPECT_DOUBLE_EQ(*f->prefix_cache_hit_rate, 0.6);
  EXPECT_EQ(f->replica_requests_routed, (std::vector<double>{10, 30}));
  EXPECT_DOUBLE_EQ(*f->replica_max_share, 0.75);
  ASSERT_EQ(f->replica_prefix_cache_hit_rate.size(), 2u);
  EXPECT_DOUBLE_EQ(*f->replica_prefix_cache_hit_rate[0], 300.0 / 500.0);
  EXPECT_NEAR(*f->router_decision_mean_ms, 2.0, 1e-9);

  // One replica (no -dp): the hit rate alone; no queries (caching off): no rate.
  EngineStats s;
  s.prefix_cache_queries = 50;
  auto one = parse_server_metrics(prometheus(Metrics{}, s, "tiny"));
  ASSERT_TRUE(one.has_value());
  auto same = server_cache_figures(*one, *one);
  ASSERT_TRUE(same.has_value());
  EXPECT_FALSE(same->prefix_cache_hit_rate.has_value());
  EXPECT_TRUE(same->replica_requests_routed.empty());
  EXPECT_FALSE(same->replica_max_share.has_value());
  EXPECT_FALSE(same->router_decision_mean_ms.has_value());

  // A restart in between: the counters went back.
  auto back = server_cache_figures(*after, *before);
  ASSERT_FALSE(back.has_value());
  EXPECT_TRUE(contains(back.status().message(), "went back")) << back.status().message();
}

TEST(BenchServeTest, OtherServersMetrics) {
  // vLLM's: the same counter names, one series per engine, summed; not ours.
  auto vllm = parse_server_metrics(
      "# HELP vllm:prefix_cache_queries_total x\n"
      "vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"m\"} 30.0\n"
      "vllm:prefix_cache_queries_total{engine=\"1\",model_name=\"m\"} 10.0\n"
      "vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"a \\\"b\\\", c\"} 4.0\r\n"
      "vllm:prefix_cache_hits_total{engine=\"1\",model_name=\"m\"} 6.0 1700000000\n");
  ASSERT_TRUE(vllm.has_value()) << vllm.status().message();
  EXPECT_FALSE(vllm->tessera);
  EXPECT_EQ(vllm->prefix_cache_queries, 40);
  EXPECT_EQ(vllm->prefix_cache_hits, 10);
  // Anything else: no figures, and why.
  for (const std::string text :
       {"", "<html>not found</html>", "http_requests_total{code=\"200\"} 3\n",
        "vllm:gpu_prefix_cache_hit_rate{model_name=\"m\"} 0.5\n"}) {
    auto got = parse_server_metrics(text);
    ASSERT_FALSE(got.has_value()) << text;
    EXPECT_TRUE(contains(got.status().message(), "not a tessera (or vLLM) server"));
  }
}

// A test directory of its own, removed at the end.
class TempDir {
 public:
  explicit TempDir(const std::string& name)
      : path_((fs::temp_directory_path() / (name + "-" + std::to_string(::getpid()))).string()) {
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

json read_json(const std::string& path) {
  std::ifstream in(path);
  return json::parse(in, nullptr, false);
}

// The issue's workload in small against a real server of two replicas behind the prefix
// router: every request completes, and the JSON has the dataset, the machine, the commit, the
// command and the server's figures: a hit rate above 0 (each prefix is asked 4 times) and the
// 12 requests split over the replicas.
TEST(BenchServeTest, PrefixRepetitionAgainstATesseraServer) {
  TempDir root("tessera-bench-serve");
  const std::string model = root.path() + "/model";
  CommandResult made = run_command(
      {bin("tessera"), "make-model", "--arch", "llama", "--preset", "tiny", "--tokenizer",
       std::string(TESSERA_SOURCE_DIR) + "/tests/assets/tokenizers/llama3", "--seed", "1", "--out",
       model},
      120s);
  ASSERT_EQ(made.exit_code, 0) << made.err;
  BackgroundProcess server(
      {bin("tessera"), "serve", model, "--device", "cpu", "--port", "0", "--served-model-name",
       "tiny", "-dp", "2", "--router", "prefix", "--max-model-len", "512"},
      {"TESSERA_TMPDIR=" + root.path()});
  int port = -1;
  wait_until(
      [&] {
        std::smatch m;
        const std::string out = server.out();
        static const std::regex ready("ready on http://127\\.0\\.0\\.1:([0-9]+)");
        if (std::regex_search(out, m, ready)) port = std::stoi(m[1]);
        return port > 0 || server.wait(0ms) != -1;
      },
      90s);
  ASSERT_GT(port, 0) << server.err();

  const std::string out = root.path() + "/bench.json";
  CommandResult r = run_command({bin("tessera"),
                                 "bench",
                                 "serve",
                                 "--base-url",
                                 "http://127.0.0.1:" + std::to_string(port),
                                 "--dataset-name",
                                 "prefix_repetition",
                                 "--prefix-repetition-prefix-len",
                                 "64",
                                 "--prefix-repetition-suffix-len",
                                 "8",
                                 "--prefix-repetition-num-prefixes",
                                 "3",
                                 "--prefix-repetition-output-len",
                                 "4",
                                 "--num-prompts",
                                 "12",
                                 "--request-rate",
                                 "40",
                                 "--seed",
                                 "1",
                                 "--ignore-eos",
                                 "--goodput",
                                 "ttft:60000",
                                 "tpot:60000",
                                 "--output-json",
                                 out},
                                120s, {"TESSERA_COMMIT=0123abcd"});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_TRUE(contains(r.out, "12 requests (prefix_repetition: 3 prefixes of 64 tokens")) << r.out;
  EXPECT_TRUE(contains(r.out, "Prefix cache hit rate (%):")) << r.out;
  EXPECT_TRUE(contains(r.out, "Requests per replica:")) << r.out;
  const json j = read_json(out);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  EXPECT_EQ(j["dataset"], "prefix_repetition");
  EXPECT_EQ(j["dataset_params"],
            (json{{"prefix_len", 64}, {"suffix_len", 8}, {"num_prefixes", 3}, {"output_len", 4}}));
  EXPECT_EQ(j["num_prompts"], 12);
  EXPECT_EQ(j["input_len"], 72);
  EXPECT_EQ(j["seed"], 1);
  EXPECT_EQ(j["request_rate"], 40.0);
  EXPECT_EQ(j["completed"], 12);
  EXPECT_EQ(j["total_input_tokens"], 12 * 72);
  EXPECT_EQ(j["total_output_tokens"], 12 * 4);
  EXPECT_NEAR(j["goodput"].get<double>(), j["request_throughput"].get<double>(), 1e-9);
  EXPECT_EQ(j["commit"], "0123abcd");
  EXPECT_FALSE(j["machine"]["hostname"].get<std::string>().empty());
  EXPECT_GT(j["machine"]["cpus"].get<int>(), 0);
  EXPECT_TRUE(contains(j["command"].get<std::string>(), "prefix_repetition")) << j["command"];
  EXPECT_TRUE(j["server_version"].is_string()) << j["server_version"];

  EXPECT_EQ(j["server_metrics"], "tessera");
  const double queries = j["prefix_cache_queries"].get<double>();
  const double hits = j["prefix_cache_hits"].get<double>();
  EXPECT_GE(queries, 12 * 64);
  EXPECT_GT(hits, 0);
  EXPECT_LE(hits, queries);
  EXPECT_DOUBLE_EQ(j["prefix_cache_hit_rate"].get<double>(), hits / queries);
  const std::vector<double> routed = j["replica_requests_routed"];
  ASSERT_EQ(routed.size(), 2u);
  EXPECT_EQ(routed[0] + routed[1], 12);
  const double share = j["replica_max_share"].get<double>();
  EXPECT_DOUBLE_EQ(share, std::max(routed[0], routed[1]) / 12);
  EXPECT_GE(share, 0.5);
  EXPECT_EQ(j["replica_prefix_cache_hit_rate"].size(), 2u);
  EXPECT_GE(j["router_decision_mean_ms"].get<double>(), 0.0);
}

// An OpenAI-compatible server that is not ours and has no /metrics: /v1/models lists "other",
// a completion streams two pieces, everything else is 404. Serves until destroyed.
class ForeignServer {
 public:
  ForeignServer() {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    if (::bind(fd_, reinterpret_cast<sockaddr*>(&addr), len) != 0 || ::listen(fd_, 64) != 0 ||
        ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      return;
    }
    port_ = ntohs(addr.sin_port);
    thread_ = std::thread([this] { serve(); });
  }
  ~ForeignServer() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
    ::close(fd_);
  }
  int port() const { return port_; }

 private:
  void serve() {
    while (!stop_) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      const int c = ::accept(fd_, nullptr, nullptr);
      if (c < 0) continue;
      answer(c);
      ::close(c);
    }
  }
  static void answer(int c) {
    std::string req;
    char buf[4096];
    size_t body_at = std::string::npos, want = 0;
    while (body_at == std::string::npos || req.size() < body_at + want) {
      const ssize_t n = ::recv(c, buf, sizeof(buf), 0);
      if (n <= 0) return;
      req.append(buf, static_cast<size_t>(n));
      if (body_at == std::string::npos && (body_at = req.find("\r\n\r\n")) != std::string::npos) {
        body_at += 4;
        std::smatch m;
        static const std::regex length("[Cc]ontent-[Ll]ength: *([0-9]+)");
        const std::string headers = req.substr(0, body_at);
        if (std::regex_search(headers, m, length)) want = std::stoul(m[1]);
      }
    }
    std::string reply;
    if (req.rfind("GET /v1/models ", 0) == 0) {
      const std::string body = R"({"object":"list","data":[{"id":"other"}]})";
      reply = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: " +
              std::to_string(body.size()) + "\r\nConnection: close\r\n\r\n" + body;
    } else if (req.rfind("POST /v1/completions ", 0) == 0) {
      reply =
          "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
          "data: {\"choices\":[{\"text\":\"a\"}]}\n\n"
          "data: {\"choices\":[{\"text\":\"b\"}]}\n\n"
          "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2}}\n\n"
          "data: [DONE]\n\n";
    } else {
      reply = "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
    }
    ::send(c, reply.data(), reply.size(), MSG_NOSIGNAL);
  }

  int fd_ = -1;
  int port_ = -1;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// Another server: the run is measured as ever, one line says why there are no cache figures,
// and they are null in the JSON.
TEST(BenchServeTest, AServerWithoutOurMetricsGetsNullFigures) {
  ForeignServer foreign;
  ASSERT_GT(foreign.port(), 0);
  TempDir root("tessera-bench-serve-foreign");
  const std::string out = root.path() + "/bench.json";
  CommandResult r = run_command(
      {bin("tessera"), "bench", "serve", "--base-url",
       "http://127.0.0.1:" + std::to_string(foreign.port()), "--dataset-name", "prefix_repetition",
       "--prefix-repetition-prefix-len", "4", "--prefix-repetition-suffix-len", "2",
       "--prefix-repetition-num-prefixes", "2", "--num-prompts", "4", "--output-json", out},
      60s);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_TRUE(contains(r.out, "Server cache figures: none (GET /metrics answered 404)")) << r.out;
  const json j = read_json(out);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  EXPECT_EQ(j["model"], "other");
  EXPECT_EQ(j["completed"], 4);
  EXPECT_TRUE(j["server_version"].is_null());
  EXPECT_EQ(j["server_metrics_error"], "GET /metrics answered 404");
  for (const char* f : {"server_metrics", "prefix_cache_queries", "prefix_cache_hits",
                        "prefix_cache_hit_rate", "replica_requests_routed", "replica_max_share",
                        "replica_prefix_cache_hit_rate", "router_decision_mean_ms", "goodput"}) {
    ASSERT_TRUE(j.contains(f)) << f;
    EXPECT_TRUE(j[f].is_null()) << f << ": " << j[f];
  }

  // A flag error comes before any request, naming the flag.
  r = run_command(
      {bin("tessera"), "bench", "serve", "--base-url",
       "http://127.0.0.1:" + std::to_string(foreign.port()), "--dataset-name", "prefix_repetition",
       "--prefix-repetition-num-prefixes", "20", "--num-prompts", "10"},
      60s);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(contains(r.err, "--num-prompts 10 is fewer than --prefix-repetition-num-prefixes 20"))
      << r.err;
}

}  // namespace
}  // namespace tessera::server
